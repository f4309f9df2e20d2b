"""The dashboard's JSON API without a browser: what each endpoint answers on a ledger of real
signed verdicts and events, that pages stay bounded, that peer text with HTML in it comes back
as inert data, that nothing private (keys, home paths) is in any answer, and that the app is
read-only."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgpack
import pytest
from starlette.testclient import TestClient

from node.bundle import BUNDLE_FORMAT
from node.web.app import MAX_STREAMS, create_app
from node.web.queries import MAX_LIMIT, LedgerQueries
from node.web.views import HIDDEN, HolderWatch, PolicyLog, RunView
from swarm.identity import NodeKey
from swarm.messages import PolicyAnnouncement, sign
from tests import ledger_factory as lf

EVIL = '<img src=x onerror="window.__pwned=1">'
HONEST = [NodeKey.from_seed(bytes([40 + i]) * 32) for i in range(3)]
CHEATER = NodeKey.from_seed(b"\x66" * 32)


class _NoDHT:
    async def find_providers(self, key: str) -> list[str]:
        return []


def _work() -> list[lf.Work]:
    work = [lf.Work(k, v, True, reward=0.25 + 0.1 * v) for v in range(4) for k in HONEST]
    work.append(lf.Work(CHEATER, 2, False, reasons=("sampling: token 3 is not the seeded choice",)))
    work.append(lf.Work(CHEATER, 3, False, reasons=(f"reason with {EVIL}",), peer_name=EVIL))
    return work


@pytest.fixture(scope="module")
def view(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunView]:
    home = tmp_path_factory.mktemp("node-home")
    store = lf.build(home / "ledger.db", _work())
    genesis = store.genesis
    policy = PolicyLog()
    for v in range(4):
        policy.record(
            sign(PolicyAnnouncement(store.run_id, v, bytes([v]) * 32, 1000 + v), lf.TRAINER)
        )
    holders = HolderWatch(
        _NoDHT(), "self", store.run_id, lambda: [e["version"] for e in policy.entries]
    )
    holders.holders = {3: [lf.TRAINER.peer_id, HONEST[0].peer_id]}
    status = {
        "peer_id": lf.VALIDATOR.peer_id,
        "role": "validator",
        "connected_peers": 4,
        "listen_addrs": ["/ip4/127.0.0.1/tcp/4001"],
        "ledger_file": str(home / "ledger.db"),  # a path a careless status could carry
        "uptime_s": 1.5,
    }
    queries = LedgerQueries(store.path, initial_balance=100, ban_threshold=0)
    yield RunView(
        run_id=store.run_id,
        genesis=genesis,
        status=lambda: status,
        policy=policy,
        holders=holders,
        queries=queries,
        roles=lambda: {lf.VALIDATOR.peer_id: "validator", lf.TRAINER.peer_id: "trainer"},
        private=(str(home), str(Path.home())),
    )
    queries.close()
    store.close()


@pytest.fixture(scope="module")
def client(view: RunView) -> Iterator[TestClient]:
    with TestClient(create_app(view, tick_s=0.05), backend="trio") as c:
        yield c


def get(client: TestClient, path: str, status: int = 200) -> Any:
    answer = client.get(path)
    assert answer.status_code == status, answer.text
    return answer.json()


def test_status_names_the_run_and_the_ledger_totals(client: TestClient) -> None:
    s = get(client, "/api/v1/status")
    assert s["api_version"] == 1
    assert s["run"]["name"] == "dashboard test"
    assert s["policy_version"] == 3
    assert s["ledger"] == {"events": 14, "verdicts": 14, "slashes": 2}


def test_contributors_count_accepted_and_rejected_work_and_ban_the_cheater(
    client: TestClient,
) -> None:
    page = get(client, "/api/v1/contributors?limit=200")
    rows = {r["peer"]: r for r in page["items"]}
    for k in HONEST:
        assert rows[k.peer_id]["accepted"] == 4
        assert rows[k.peer_id]["balance"] == 104
        assert not rows[k.peer_id]["banned"]
        assert rows[k.peer_id]["role"] == "inference"
    cheater = rows[CHEATER.peer_id]
    assert (cheater["rejected"], cheater["balance"], cheater["banned"]) == (1, 100 - 1000, True)
    assert rows[lf.VALIDATOR.peer_id]["judged"] == 14
    assert rows[lf.TRAINER.peer_id]["role"] == "trainer"


def test_contributors_show_each_workers_requests_of_the_newest_version(
    client: TestClient, view: RunView
) -> None:
    rows = {r["peer"]: r for r in get(client, "/api/v1/contributors?limit=200")["items"]}
    assert rows[HONEST[0].peer_id]["requests"]["text"] == "1 (v3)"  # this run has no quota
    assert rows[lf.VALIDATOR.peer_id]["requests"] is None  # not a worker
    assert view.queries is not None
    quota = LedgerQueries(
        view.queries.path, initial_balance=100, ban_threshold=0, quota=64, window=3
    )
    try:
        page = quota.contributors(roles={}, live_seen_ms={}, limit=200)
    finally:
        quota.close()
    rows = {r["peer"]: r for r in page["items"]}
    honest = rows[HONEST[0].peer_id]["requests"]
    assert (honest["version"], honest["submitted"], honest["quota"]) == (3, 1, 64)
    assert honest["text"] == "1 of 64 (v3)"
    # The cheater's last verdict is of v2: of the newest version it submitted nothing.
    assert rows[CHEATER.peer_id]["requests"]["text"] == "0 of 64 (v3)"


def test_contributors_sort_and_search(client: TestClient) -> None:
    asc = get(client, "/api/v1/contributors?sort=balance&order=asc")["items"]
    assert [r["balance"] for r in asc] == sorted(r["balance"] for r in asc)
    needle = HONEST[1].peer_id[-10:].lower()
    found = get(client, f"/api/v1/contributors?search={needle}")["items"]
    assert [r["peer"] for r in found] == [HONEST[1].peer_id]


def test_pages_are_bounded_and_cursors_walk_every_row(client: TestClient) -> None:
    seen, cursor = [], None
    while True:
        q = "/api/v1/ledger?limit=5" + (f"&cursor={cursor}" if cursor else "")
        page = get(client, q)
        assert len(page["items"]) <= 5
        seen += [e["id"] for e in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(seen) == len(set(seen)) == 14
    huge = get(client, "/api/v1/ledger?limit=1000000")
    assert len(huge["items"]) <= MAX_LIMIT
    people, cursor = [], None
    while True:
        page = get(client, "/api/v1/contributors?limit=2" + (f"&cursor={cursor}" if cursor else ""))
        people += [r["peer"] for r in page["items"]]
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert len(people) == len(set(people)) == page["total"]


@pytest.mark.parametrize(
    "query",
    [
        "/api/v1/ledger?limit=ten",
        "/api/v1/ledger?cursor=drop%20table",
        "/api/v1/contributors?sort=secret",
        "/api/v1/contributors?order=sideways",
        "/api/v1/bundles/abcd",
    ],
)
def test_bad_parameters_are_a_clear_400(client: TestClient, query: str) -> None:
    assert get(client, query, 400)["error"]


def test_rewards_per_version_raw_and_smoothed_and_eval_absent(client: TestClient) -> None:
    page = get(client, "/api/v1/rewards")
    by_version = {r["version"]: r for r in page["items"]}
    assert by_version[0]["mean_reward"] == pytest.approx(0.25)
    assert by_version[3]["mean_reward"] == pytest.approx(0.55)
    assert by_version[3]["smoothed"] == pytest.approx((0.25 + 0.35 + 0.45 + 0.55) / 4)
    assert by_version[2]["rejected"] == 1
    assert page["eval"]["available"] is False and page["eval"]["reason"]


def test_versions_with_holders(client: TestClient) -> None:
    page = get(client, "/api/v1/versions?limit=2")
    assert [v["version"] for v in page["items"]] == [3, 2]
    assert page["items"][0]["holders"] == [lf.TRAINER.peer_id, HONEST[0].peer_id]
    rest = get(client, f"/api/v1/versions?limit=2&cursor={page['next_cursor']}")
    assert [v["version"] for v in rest["items"]] == [1, 0]
    shard = get(client, "/api/v1/shardcast")
    assert shard["holders"] == [{"version": 3, "peers": [lf.TRAINER.peer_id, HONEST[0].peer_id]}]


def test_slashes_carry_reasons_and_a_bundle_that_audit_reads(client: TestClient) -> None:
    page = get(client, "/api/v1/slashes")
    assert len(page["items"]) == 2
    first = next(s for s in page["items"] if s["peer"] == CHEATER.peer_id)
    assert first["reasons"] == ["sampling: token 3 is not the seeded choice"]
    assert first["evidence_held"] is True
    answer = client.get(first["bundle_url"])
    assert answer.status_code == 200
    assert answer.headers["content-disposition"].startswith("attachment;")
    bundle = msgpack.unpackb(answer.content, raw=False)
    assert bundle["format"] == BUNDLE_FORMAT
    assert set(bundle) == {"format", "genesis", "submission", "verdict", "related"}
    missing = client.get("/api/v1/bundles/" + "00" * 32)
    assert missing.status_code == 404 and "evidence" in missing.json()["error"]


def test_disputes_list_is_there_and_empty_without_disputes(client: TestClient) -> None:
    assert get(client, "/api/v1/disputes") == {"items": [], "next_cursor": None, "supported": True}


def test_peer_text_with_html_comes_back_as_inert_json_data(client: TestClient) -> None:
    answer = client.get("/api/v1/slashes")
    assert answer.headers["content-type"].startswith("application/json")
    assert answer.headers["x-content-type-options"] == "nosniff"
    assert "script-src 'self'" in answer.headers["content-security-policy"]
    evil = next(s for s in answer.json()["items"] if s["peer"] == EVIL)
    assert evil["reasons"] == [f"reason with {EVIL}"]  # exact data, for textContent
    assert "worker=%3Cimg" in evil["bundle_url"]  # the link's query is URL-encoded
    people = get(client, "/api/v1/contributors?search=onerror")["items"]
    assert [p["peer"] for p in people] == [EVIL]


def test_the_page_shows_peer_text_only_through_text_content(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "script-src 'self'" in page.headers["content-security-policy"]
    script = client.get("/static/app.js").text
    for sink in ("innerHTML", "outerHTML", "insertAdjacentHTML", "document.write", "eval("):
        assert sink not in script
    assert "textContent" in script


def test_no_answer_carries_key_material_or_home_paths(client: TestClient, view: RunView) -> None:
    secrets = [str(Path.home()), *view.private]
    for key in (lf.VALIDATOR, lf.TRAINER, lf.OWNER):
        import base64

        secrets += [
            key.seed.hex(),
            base64.b64encode(key.seed).decode(),
            key.to_pem().decode()[30:80],
        ]
    paths = [
        "status",
        "versions",
        "rewards",
        "contributors",
        "slashes",
        "disputes",
        "ledger",
        "shardcast",
    ]
    for path in paths:
        text = client.get(f"/api/v1/{path}").text
        for secret in secrets:
            assert secret not in text, (path, secret)
    status = get(client, "/api/v1/status")
    assert status["node"]["ledger_file"] == HIDDEN
    assert "PRIVATE KEY" not in json.dumps(status)


def test_the_app_is_read_only(client: TestClient) -> None:
    for method in ("post", "put", "delete", "patch"):
        assert getattr(client, method)("/api/v1/contributors").status_code == 405


def test_live_stream_sends_an_update_event(client: TestClient) -> None:
    with client.stream("GET", "/api/v1/stream") as stream:
        assert stream.headers["content-type"].startswith("text/event-stream")
        lines = stream.iter_lines()
        got = []
        for line in lines:
            got.append(line)
            if line.startswith("data:"):
                break
    data = json.loads(got[-1][len("data:") :])
    assert data["policy_version"] == 3 and data["seq"] >= 1
    assert "event: update" in got
    assert MAX_STREAMS >= 10
