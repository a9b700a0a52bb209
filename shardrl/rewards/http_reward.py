"""A reward function served over HTTP: each sample is POSTed as JSON `{data_source, solution_str, ground_truth,
extra_info}` and the answer, JSON too, must be what a reward function returns (a number, or a dict with a numeric
"score"), checked as for GuardedScoreFn.

A 5xx answer, a refused or dropped connection and a timeout are retried with exponential backoff (the server may be
busy or restarting); a 4xx is refused at once (the request itself is wrong, and will be again). `timeout` bounds
connecting and each read from the socket; a server that keeps sending a byte now and then is not cut off.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json
import reprlib
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any

from shardrl.rewards.outcomes import BatchScores, OnError, Sample, check_on_error, collect_scores
from shardrl.usercode.pool import check_positive
from shardrl.usercode.wire import describe, encode

_FIELDS = ("data_source", "solution_str", "ground_truth", "extra_info")


class HttpRewardClient:
    """Scores batches at `url`, up to `max_concurrency` requests at once. A failed attempt is tried again up to
    `retries` times, after `backoff`, then twice that, and so on (seconds)."""

    def __init__(self, url: str, *, max_concurrency: int, timeout: float, retries: int, backoff: float,
                 on_error: OnError = "fail") -> None:
        check_positive("HttpRewardClient", max_concurrency=max_concurrency, timeout=timeout)
        if retries < 0 or backoff < 0:
            raise ValueError(f"HttpRewardClient retries and backoff must be >= 0, got {retries!r} and {backoff!r}")
        check_on_error(on_error)
        self.url = url
        self.max_concurrency = max_concurrency
        self.timeout = timeout
        self.retries = retries
        self.backoff = backoff
        self.on_error = on_error

    def score_batch(self, samples: Sequence[Sample]) -> BatchScores:
        """Score every sample, `max_concurrency` at a time; the results in order. A TypeError (the caller's bug) for
        a sample JSON cannot carry (numpy values can)."""
        bodies = [encode(dict(zip(_FIELDS, sample, strict=True))) for sample in samples]
        with concurrent.futures.ThreadPoolExecutor(self.max_concurrency, "http-reward") as threads:
            outcomes = list(threads.map(self._post, bodies))
        return collect_scores(f"reward server {self.url}", samples, outcomes, self.on_error)

    def _post(self, body: bytes) -> tuple[Any, str | None]:
        """(the answer, None), or (None, why there is none) once retries are spent or the server refused."""
        request = urllib.request.Request(self.url, body, {"Content-Type": "application/json"}, method="POST")
        for attempt in range(self.retries + 1):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as response:
                    text = response.read()
            except urllib.error.HTTPError as exc:  # before URLError: it is one
                problem = f"HTTP {exc.code} {exc.reason}"
                if exc.code < 500:
                    return None, problem
            except (OSError, http.client.HTTPException) as exc:  # URLError and socket timeouts are OSErrors
                problem = self._unreachable(exc)
            else:
                try:
                    return json.loads(text), None
                except ValueError:
                    return None, f"answered {reprlib.repr(text)}, which is not JSON"
        return None, f"{problem} (after {self.retries + 1} attempts)" if self.retries else problem

    def _unreachable(self, exc: OSError | http.client.HTTPException) -> str:
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        if isinstance(reason, TimeoutError):
            return f"timed out after {self.timeout:g} s"
        return f"unreachable ({describe(reason) if isinstance(reason, BaseException) else reason})"
