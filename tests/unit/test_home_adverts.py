"""The home remembers its node's last advert issue times (the twin check after a restart)."""

from __future__ import annotations

from pathlib import Path

from node.home import ADVERTS_ISSUED, KEEP_ISSUED, NodeHome


def test_issue_times_survive_a_restart_and_only_the_last_are_kept(tmp_path: Path) -> None:
    home = NodeHome(tmp_path / "home")
    assert home.adverts_issued("run") == []
    for issued in range(1, KEEP_ISSUED + 5):
        home.note_advert_issued("run", issued)
    assert NodeHome(home.path).adverts_issued("run") == list(range(5, KEEP_ISSUED + 5))
    assert home.adverts_issued("another run") == []


def test_a_torn_file_means_no_previous_life_known_and_is_rewritten(tmp_path: Path) -> None:
    home = NodeHome(tmp_path / "home")
    path = home.run_dir("run") / ADVERTS_ISSUED
    path.parent.mkdir(parents=True)
    path.write_text("12\n3x")
    assert home.adverts_issued("run") == []
    home.note_advert_issued("run", 40)
    assert home.adverts_issued("run") == [40]
