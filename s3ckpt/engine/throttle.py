"""Adaptive limits on the requests one store is sent, for stores that shed load. No I/O.

A store that admits R requests a second answers the rest ``SlowDown`` (503), 429 or a throttling
code (`retry.is_throttling`). Backoff alone does not bring the sender down to R: every request in
flight retries on its own, new ones keep coming, and most of what is sent is answered 503 (a
retry storm; each refusal costs the store too). `Throttle` sends less instead, with two limits
that a throttling answer turns on and that turn themselves off once they have grown back, so
a store that never throttles is sent exactly what it was before (one comparison per request):

- A concurrency window: at most ``limit`` requests in flight. On a throttling answer it becomes
  0.7 x the requests then in flight (floor 1), and grows by one per window of ``limit``
  admitted answers (AIMD, as TCP does per round trip), off again at the ceiling,
  ``max_concurrency``. It holds a store that sheds load by requests open at once; alone it
  cannot hold a fast store to a rate: one request in flight answered in 10 ms is 100 requests a
  second (measured, `benchmarks.bench_throttle`'s proxy at 20/s: 70% refused, as with backoff
  alone; pacing alone and both: 3-5%).
- A send rate (a token bucket, as in the AWS SDKs' adaptive retry mode): on a throttling answer
  it becomes 0.7 x the rate the store was being sent (measured over the last second or since
  the sending began, and never above the paced rate), then grows back as a cubic of the time
  since (CUBIC): quickly at first, flat near the rate that was refused, then probing beyond it.
  Off again once it has doubled without a throttling answer and is twice what is being sent
  (pacing no longer holds anything back: lifting it while it does would send a burst). Never
  below ``MIN_RATE``.

Only a throttling answer to a request sent after the last cut cuts again, so the burst of
refusals of requests that were already in flight counts once, as one round trip's worth; and
only while other requests are in flight or waiting: a lone request (a bucket check, a record's
GET) is spaced by its own backoff already, and the rate it is sent at says nothing of the
store's, so cutting from it would only hold back the save that follows. Both
limits apply to every request to the store, the small ones (HEAD, LIST, completes) included,
since a store's rate limit counts them all. A request waits for them only between its attempts,
never while holding anything a request in flight needs, so they cannot deadlock with the
store's request slots (a slot holder waits here; nothing here waits for a slot).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import math
from typing import Literal

__all__ = ["BETA", "MIN_RATE", "Answer", "Throttle"]

BETA = 0.7  # what a throttling answer leaves of either limit (the AWS SDKs' adaptive mode: 0.7)
CUBIC_SCALE = 0.4  # requests/s per s^3 of the rate's cubic growth (the AWS SDKs': 0.4)
MIN_RATE = 0.5  # requests/s; a rate limit never goes below it (the AWS SDKs': 0.5)
_RATE_WINDOW_S = 1.0  # the sent rate is measured over about this long (exponential decay)
_MIN_SPAN_S = 0.01  # a rate measured over less time than this is measured over this
# Tokens a paced store may bank: a wake-up admits all it has, and the loop's timers fire at
# millisecond granularity, so a bucket of one token would cap the rate near 1,000 a second.
_BURST_S = 0.02

Answer = Literal["admitted", "throttled", "failed"]
"""How an attempt ended, for `Throttle.done`: ``admitted`` (the store answered: a success, or
an error no retry changes, such as 404), ``throttled`` (a throttling answer), ``failed`` (any
other transient failure, or cancelled: says nothing about the store's rate)."""


class Throttle:
    """The concurrency window and send rate of one store (see the module docstring); on the
    `bridge` loop. `admit` before each attempt, `done` with its ticket after it."""

    def __init__(self, ceiling: int) -> None:
        self.ceiling = ceiling
        self.in_flight = 0
        self.limit: float | None = None  # the concurrency window; None: off
        self.paced = False
        self._epoch = 0  # cuts so far: a ticket of an earlier epoch cannot cut again
        self._w_max = 0.0  # the rate cut from, and the cubic's plateau
        self._k = 0.0  # seconds from the cut until the cubic is back at _w_max
        self._cut_at = 0.0
        self._tokens = 0.0
        self._filled = 0.0
        self._sent = 0.0  # requests sent, decaying over _RATE_WINDOW_S
        self._sent_at = -math.inf
        self._since = 0.0  # when the sending that _sent counts began (after a quiet window)
        self._waiters: collections.deque[asyncio.Future[int]] = collections.deque()
        self._timer: asyncio.TimerHandle | None = None

    @property
    def active(self) -> bool:
        """Whether either limit is on (a throttling answer was met and not yet outgrown)."""
        return self.limit is not None or self.paced

    def rate(self, now: float) -> float:
        """The paced rate in requests/s at loop time ``now`` (meaningful while `paced`)."""
        grown = CUBIC_SCALE * (now - self._cut_at - self._k) ** 3 + self._w_max
        return max(MIN_RATE, grown)

    def sent_rate(self, now: float) -> float:
        """Requests/s sent lately: the decaying count over the time it covers, which is less
        than its time constant when the sending began just now (a save's first burst)."""
        count = self._sent * math.exp((self._sent_at - now) / _RATE_WINDOW_S)
        span = _RATE_WINDOW_S * -math.expm1((self._since - now) / _RATE_WINDOW_S)
        return count / max(span, _MIN_SPAN_S)

    async def admit(self) -> int:
        """Wait until both limits let one more request go; returns its ticket for `done`."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        if not self._waiters and self._allows(now):
            return self._take(now)
        waiter: asyncio.Future[int] = loop.create_future()
        self._waiters.append(waiter)
        self._pump()
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():  # admitted, then cancelled: give back
                self.in_flight -= 1
                self._pump()
            else:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)
            raise

    def done(self, ticket: int, answer: Answer) -> None:
        """The attempt that `admit` returned ``ticket`` for has ended with ``answer``."""
        self.answered(ticket, answer, asyncio.get_running_loop().time())
        if self._waiters:
            self._pump()

    def answered(self, ticket: int, answer: Answer, now: float) -> None:
        """`done` at loop time ``now``, without waking waiters (the limits' arithmetic)."""
        if answer == "throttled":
            if ticket == self._epoch and (self.in_flight > 1 or self._waiters):
                self._cut(now)
        elif answer == "admitted":
            if self.limit is not None:
                self.limit += 1 / self.limit
                if self.limit >= self.ceiling:
                    self.limit = None
            if self.paced and self.rate(now) >= 2 * max(self._w_max, self.sent_rate(now)):
                self.paced = False
        self.in_flight -= 1

    def _cut(self, now: float) -> None:
        """A throttling answer to a request sent since the last cut: both limits x `BETA`."""
        self._epoch += 1
        window = self.ceiling if self.limit is None else self.limit
        self.limit = max(1.0, BETA * min(window, self.in_flight))
        sent = self.sent_rate(now)
        if self.paced:
            self._refill(now)
            sent = min(sent, self.rate(now))
        self._w_max = sent
        self._k = (sent * (1 - BETA) / CUBIC_SCALE) ** (1 / 3)
        self._cut_at = now
        self._tokens = min(self._tokens, self._capacity(now)) if self.paced else 0.0
        self._filled = now
        self.paced = True

    def _capacity(self, now: float) -> float:
        return max(1.0, self.rate(now) * _BURST_S)

    def _refill(self, now: float) -> None:
        self._tokens = min(
            self._capacity(now), self._tokens + (now - self._filled) * self.rate(now)
        )
        self._filled = now

    def _allows(self, now: float) -> bool:
        if self.limit is not None and self.in_flight + 1 > self.limit:
            return False
        if self.paced:
            self._refill(now)
            return self._tokens >= 1
        return True

    def _take(self, now: float) -> int:
        self.in_flight += 1
        if self.paced:
            self._tokens -= 1
        if now - self._sent_at > _RATE_WINDOW_S:
            self._sent, self._since = 0.0, now
        self._sent = self._sent * math.exp((self._sent_at - now) / _RATE_WINDOW_S) + 1
        self._sent_at = now
        return self._epoch

    def _pump(self) -> None:
        """Admit waiters in order while both limits allow; if the rate holds the next one back,
        wake up when its token is due (a finished request wakes them when the window does)."""
        loop = asyncio.get_running_loop()
        now = loop.time()
        while self._waiters:
            waiter = self._waiters[0]
            if waiter.done():  # cancelled while waiting
                self._waiters.popleft()
                continue
            if not self._allows(now):
                break
            self._waiters.popleft()
            waiter.set_result(self._take(now))
        window_open = self.limit is None or self.in_flight + 1 <= self.limit
        if self._waiters and self.paced and window_open and self._timer is None:
            due = (1 - self._tokens) / self.rate(now)
            self._timer = loop.call_later(due, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._pump()
