"""The store's adaptive limits (`s3ckpt.engine.throttle`): off until a throttling answer, cut by
one per round trip, grown back and lifted, pacing that holds to its rate, no deadlock with the
request slots; and how `Calls.retrying` feeds them. No server."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import Any

import pytest

from s3ckpt import StorageError
from s3ckpt.config import S3Config
from s3ckpt.engine.calls import Calls
from s3ckpt.engine.throttle import BETA, MIN_RATE, Throttle


def calls_for(**settings: Any) -> Calls:
    config = S3Config(endpoint_url="http://127.0.0.1:9", access_key_id="a", secret_access_key="b")
    return Calls(dataclasses.replace(config, **settings).resolve({}))


def failing(code: str, status: int | None) -> StorageError:
    return StorageError(f"failed: {code}", code=code, status=status, bucket="b", key="k")


async def admitted(throttle: Throttle, count: int) -> list[int]:
    return [await throttle.admit() for _ in range(count)]


def test_an_unthrottled_store_is_never_held_back() -> None:
    async def scenario() -> None:
        throttle = Throttle(16)
        began = time.monotonic()
        tickets = await asyncio.wait_for(admitted(throttle, 1000), 1.0)
        assert throttle.in_flight == 1000 and not throttle.active, "no ceiling while unthrottled"
        for ticket in tickets:
            throttle.done(ticket, "failed")
        assert time.monotonic() - began < 1.0 and throttle.in_flight == 0

    asyncio.run(scenario())


def test_a_throttling_answer_cuts_both_limits_once_per_round_trip() -> None:
    async def scenario() -> None:
        throttle, now = Throttle(16), asyncio.get_running_loop().time
        tickets = await admitted(throttle, 10)
        sent = throttle.sent_rate(now())
        throttle.done(tickets[0], "throttled")
        assert throttle.limit == pytest.approx(BETA * 10)
        assert throttle.paced and throttle.rate(now()) == pytest.approx(BETA * sent, rel=0.01)
        # The other nine were sent before the cut: their refusals are the same round trip.
        for ticket in tickets[1:]:
            throttle.done(ticket, "throttled")
        assert throttle.limit == pytest.approx(BETA * 10)
        # A request sent after the cut and refused cuts again, while another is in flight.
        other, again = await throttle.admit(), await throttle.admit()
        throttle.done(again, "throttled")
        assert throttle.limit == pytest.approx(BETA * 2)
        throttle.done(other, "admitted")


def test_a_lone_request_refused_cuts_nothing() -> None:
    """Its backoff spaces its retries; its rate says nothing of the store's."""

    async def scenario() -> None:
        throttle = Throttle(16)
        for _ in range(6):
            throttle.done(await throttle.admit(), "throttled")
        assert not throttle.active

    asyncio.run(scenario())

    asyncio.run(scenario())


def test_the_window_grows_by_one_per_window_of_answers_and_lifts_at_the_ceiling() -> None:
    throttle = Throttle(4)
    throttle.limit = 1.0
    throttle.in_flight = 10
    answers = 0
    while throttle.limit is not None:
        throttle.answered(0, "admitted", 0.0)
        answers += 1
    # 1/limit per answer: one answer from 1 to 2, about two from 2 to 3, three from 3 to 4.
    assert 1 + 2 + 3 <= answers <= 1 + 2 + 3 + 1, answers
    throttle.limit = 2.0
    throttle.answered(0, "failed", 0.0)
    assert throttle.limit == 2.0, "a reset or a 500 says nothing about the store's rate"


def test_the_rate_grows_back_as_a_cubic_and_pacing_lifts_once_it_doubled() -> None:
    async def scenario() -> None:
        throttle, loop = Throttle(16), asyncio.get_running_loop()
        tickets = await admitted(throttle, 8)
        throttle.done(tickets[0], "throttled")
        cut, w_max = loop.time(), throttle.rate(loop.time()) / BETA
        k = (w_max * (1 - BETA) / 0.4) ** (1 / 3)
        assert throttle.rate(cut + k) == pytest.approx(w_max, rel=0.01)
        assert throttle.rate(cut + k / 2) < throttle.rate(cut + k) < throttle.rate(cut + 2 * k)
        throttle.answered(tickets[1], "admitted", cut + k)
        assert throttle.paced, "still paced at the rate that was refused"
        doubled = cut + k + (w_max / 0.4) ** (1 / 3)
        throttle.answered(tickets[2], "admitted", doubled + 0.01)
        assert not throttle.paced

    asyncio.run(scenario())


def test_pacing_holds_requests_to_the_rate() -> None:
    """Cut from a measured 100 requests/s: 20 further requests take at least 20 / 70 s."""

    async def scenario() -> None:
        throttle, loop = Throttle(16), asyncio.get_running_loop()
        for _ in range(100):  # 100 requests/s for a second, one at a time
            throttle.done(await throttle.admit(), "admitted")
            await asyncio.sleep(0.01)
        other = await throttle.admit()
        throttle.done(await throttle.admit(), "throttled")
        throttle.done(other, "admitted")
        rate = throttle.rate(loop.time())
        assert 40 < rate < BETA * 100 * 1.05
        began = loop.time()
        for _ in range(20):
            throttle.done(await throttle.admit(), "admitted")
        assert loop.time() - began >= 19 / (rate * 1.1)

    asyncio.run(scenario())


def test_the_rate_never_falls_below_its_floor() -> None:
    throttle = Throttle(16)
    throttle.in_flight = 2
    throttle.answered(0, "throttled", 100.0)  # nothing sent lately: a measured rate of 0
    assert throttle.paced and throttle.rate(100.0) == MIN_RATE


def test_a_waiter_cancelled_while_held_back_leaves_nothing_behind() -> None:
    async def scenario() -> None:
        throttle = Throttle(16)
        first, second = await throttle.admit(), await throttle.admit()
        throttle.done(first, "throttled")  # window 1 (0.7 x 2 in flight), paced
        holder = second
        waiting = asyncio.ensure_future(throttle.admit())
        after = asyncio.ensure_future(throttle.admit())
        await asyncio.sleep(0.05)
        assert not waiting.done() and not after.done(), "held back by the window of one"
        waiting.cancel()
        throttle.done(holder, "admitted")
        ticket = await asyncio.wait_for(after, 5.0)
        assert throttle.in_flight == 1
        throttle.done(ticket, "admitted")
        assert throttle.in_flight == 0

    asyncio.run(scenario())


def test_slot_holders_waiting_for_the_window_never_deadlock() -> None:
    """Slots (outer) and the window (inner), a window cut to one: 40 requests all finish."""

    async def scenario() -> None:
        throttle, slots, finished = Throttle(4), asyncio.Semaphore(4), 0

        async def request(refused: bool) -> None:
            nonlocal finished
            async with slots:
                ticket = await throttle.admit()
                await asyncio.sleep(0.001)
                throttle.done(ticket, "throttled" if refused else "admitted")
            finished += 1

        await asyncio.wait_for(asyncio.gather(*(request(i % 8 == 0) for i in range(40))), 30)
        assert finished == 40 and throttle.in_flight == 0

    asyncio.run(scenario())


def test_retrying_tells_the_throttle_what_it_met() -> None:
    """Ten requests at once, each refused twice: the store's limits tighten."""
    calls = calls_for()
    refusals: dict[int, int] = {}

    async def attempt(number: int) -> str:
        refusals[number] = refusals.get(number, 0) + 1
        await asyncio.sleep(0.01)
        if refusals[number] <= 2:
            raise failing("SlowDown", 503)
        return "ok"

    async def scenario() -> list[str]:
        requests = (
            calls.retrying("put_object", "b", f"k{n}", lambda n=n: attempt(n)) for n in range(10)
        )
        return await asyncio.gather(*requests)

    assert asyncio.run(scenario()) == ["ok"] * 10
    assert calls.stats.throttled == 20 and calls.throttle.active
    assert calls.throttle.in_flight == 0


def test_without_adaptation_a_throttled_store_is_only_retried() -> None:
    calls = calls_for(adapt_to_throttling=False)
    refused: set[int] = set()

    async def attempt(number: int) -> str:
        await asyncio.sleep(0.01)
        if number not in refused:
            refused.add(number)
            raise failing("SlowDown", 503)
        return "ok"

    async def scenario() -> list[str]:
        requests = (
            calls.retrying("put_object", "b", f"k{n}", lambda n=n: attempt(n)) for n in range(10)
        )
        return await asyncio.gather(*requests)

    assert asyncio.run(scenario()) == ["ok"] * 10
    assert calls.stats.throttled == 10 and not calls.throttle.active


def test_waiting_to_be_let_through_is_not_part_of_the_retry_window() -> None:
    """The first attempt waits half a second for the paced store; the 0.3 s window starts only
    when it is sent, so its failure is still retried."""
    calls, outcomes = calls_for(retry_timeout=0.3), ["500", "ok"]

    async def attempt() -> str:
        if outcomes.pop(0) == "500":
            raise failing("InternalError", 500)
        return "ok"

    async def scenario() -> float:
        throttle, loop = calls.throttle, asyncio.get_running_loop()
        throttle.in_flight = 2
        throttle.answered(0, "throttled", loop.time())  # paced at the floor, no token yet
        throttle.in_flight = 0
        began = loop.time()
        assert await calls.retrying("put_object", "b", "k", attempt) == "ok"
        return loop.time() - began

    assert asyncio.run(scenario()) >= 0.9 / MIN_RATE / 2
