"""``wait_until``'s timeout names the test's own line, through a helper that wraps it."""

from __future__ import annotations

import pytest

from tests.netfactory import WaitTimedOut, wait_until


async def _helper_wait() -> None:
    await wait_until(lambda: False, 0.05, poll=0.01)


async def test_a_timeout_names_the_helper_and_the_test_line_that_called_it() -> None:
    with pytest.raises(WaitTimedOut) as caught:
        await _helper_wait()
    text = str(caught.value)
    assert "test_wait_until.py:11: await wait_until(lambda: False" in text, text
    assert "called at test_wait_until.py:16: await _helper_wait()" in text, text


async def test_a_direct_wait_names_only_the_test_line() -> None:
    with pytest.raises(WaitTimedOut, match=r"after 0.05 s at test_wait_until.py:24: ") as caught:
        await wait_until(lambda: None, 0.05, poll=0.01)
    assert "called at" not in str(caught.value)
