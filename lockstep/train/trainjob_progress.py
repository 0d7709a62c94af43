"""TrainJob progress: rank 0 reports progress, ETA and metrics to Kubeflow Trainer (v2.2+), which
shows them in `status.trainerStatus` (`kubectl get trainjob NAME -o
jsonpath='{.status.trainerStatus}'`).

The contract (Trainer's docs/user-guides/trainjob-progress.md, pkg/statusserver/server.go,
TrainerStatus in pkg/apis/trainer/v1alpha1/trainjob_types.go): the controller injects
KUBEFLOW_TRAINER_SERVER_URL (an https URL), KUBEFLOW_TRAINER_SERVER_CA_CERT (the CA file that signs
the server's certificate) and KUBEFLOW_TRAINER_SERVER_TOKEN (a file holding a projected
service-account token, which rotates: it is read again every TOKEN_MAX_AGE_S seconds and after a
403). The trainer POSTs {"trainerStatus": {...}} with `Authorization: Bearer <token>`; the server
answers 200 with the payload, or a metav1.Status JSON (403 for a token it does not accept, 422 for a
payload the CRD refuses). The CRD's rules: progressPercentage an int 0-100,
estimatedRemainingSeconds an int >= 0 (int32), at most 256 metrics, each a name and a value string
of 1-64 characters, lastUpdatedTime (RFC 3339) required.

What lockstep sends, at the log interval but at most every `interval` s (5, as HF's KubeflowCallback
and the Kubeflow SDK): the percentage of this run's steps done (at most 99 until the run finished,
then 100), the seconds left at this attempt's step rate (lockstep.metrics.remaining_seconds, the
console's ETA), and the metrics loss, eval_loss, learning_rate, tokens_per_s, current_step,
total_steps, epoch (epochs done, as HF's float epoch) and epochs (the total, in an epoch-bound run),
and the last committed checkpoint: checkpoint_step and checkpoint, the checkpoint directory's name
(`step_00000032`). Its full path can pass the 64-character limit, so it is not sent; the rank log
has it ("checkpoint committed"). HF's names are used where HF reports the same value, so HF and
lockstep jobs read alike in kubectl. DISABLE_KUBEFLOW_INTEGRATION=TRUE turns reporting off, as it
does HF's.

No new dependency: one small JSON POST every few seconds needs urllib and ssl from the standard
library, not an HTTP client package in every install.

Never in training's way: requests go out on a thread of their own, so a step only hands over the
newest status (microseconds) and never waits on the server; the end of the run waits at most
`timeout` s for the final report. A server that fails (down, 403, 422, a timeout, a certificate the
CA does not sign) costs one WARNING naming the status and the server's message; later failures are
logged at DEBUG, reports go on at the same interval, and a server that answers again gets one INFO
line.
"""

from __future__ import annotations

import json
import logging
import os
import ssl
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from lockstep.checkpoint.manifest import STEP_DIR

ENV_URL = "KUBEFLOW_TRAINER_SERVER_URL"
ENV_CA_CERT = "KUBEFLOW_TRAINER_SERVER_CA_CERT"
ENV_TOKEN = "KUBEFLOW_TRAINER_SERVER_TOKEN"
ENV_DISABLE = "DISABLE_KUBEFLOW_INTEGRATION"  # HF's switch; lockstep honours the same one
TOKEN_MAX_AGE_S = 60.0  # kubelet renews a projected token at 80% of its lifetime (>= 10 min)
MAX_TEXT = 64  # a metric's name and value: 1-64 characters (the CRD's MinLength / MaxLength)
MAX_METRICS = 256
# estimatedRemainingSeconds is an int32: a larger number fails to decode (422)
INT32_MAX = 2**31 - 1
# lockstep's record key -> the metric name HF's KubeflowCallback uses for the same value
METRIC_NAMES = {
    "loss": "loss",
    "lr": "learning_rate",
    "tokens_per_s": "tokens_per_s",
    "epoch": "epoch",
    "epochs": "epochs",
}


@dataclass(frozen=True)
class Endpoint:
    """Where and how to report: the status server's URL, its CA file, the token file."""

    url: str
    ca_cert: str | None
    token_file: str | None


def endpoint_from_environ(environ: Mapping[str, str]) -> Endpoint | None:
    """The endpoint the Trainer controller injected; None outside a TrainJob or when turned off."""
    url = environ.get(ENV_URL)
    if not url or environ.get(ENV_DISABLE, "FALSE").upper() == "TRUE":
        return None
    return Endpoint(url, environ.get(ENV_CA_CERT) or None, environ.get(ENV_TOKEN) or None)


def _text(value: float | int | str) -> str:
    text = f"{value:.6g}" if isinstance(value, float) else str(value)
    return text[-MAX_TEXT:]  # a name's tail says most (step_00000032); numbers never get near 64


def trainer_status(
    step: int,
    total_steps: int,
    values: Mapping[str, float],
    eval_loss: float | None,
    checkpoint: Path | None,
    finished: bool,
    now: datetime,
) -> dict:
    """The trainerStatus of `step`: what the CRD accepts (see the module docstring)."""
    percent = 100 if finished else min(99, 100 * step // max(total_steps, 1))
    metrics = {METRIC_NAMES[k]: v for k, v in values.items() if k in METRIC_NAMES}
    if eval_loss is not None:
        metrics["eval_loss"] = eval_loss
    metrics.update(current_step=step, total_steps=total_steps)
    if checkpoint is not None:
        # an HF Trainer checkpoint the run resumed from has no step_ name
        found = STEP_DIR.match(checkpoint.name)
        if found:
            metrics["checkpoint_step"] = int(found[1])
        metrics["checkpoint"] = checkpoint.name
    pairs = [{"name": _text(k), "value": _text(v)} for k, v in metrics.items()]
    status = {
        "progressPercentage": percent,
        "metrics": pairs[:MAX_METRICS],
        "lastUpdatedTime": now.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }
    if finished or "eta_s" in values:  # before the first log line the rate is unknown: no ETA
        eta = 0 if finished else values["eta_s"]
        status["estimatedRemainingSeconds"] = min(INT32_MAX, max(0, round(eta)))
    return status


class ReportError(Exception):
    """A report the server did not take: the status (or what failed before one) and its message."""


class TrainJobProgress:
    """A MetricsWriter sink that reports to the TrainJob's status server; does nothing without one.

    The loop hands it the committed checkpoint (note_checkpoint) and, at the end, whether the run
    finished (finish); the MetricsWriter hands it every record. Use it as a context manager: leaving
    the block stops its thread.
    """

    def __init__(
        self,
        endpoint: Endpoint | None,
        total_steps: int,
        log: logging.Logger,
        interval: float = 5.0,
        timeout: float = 5.0,
    ):
        self.endpoint, self.total_steps, self.logger = endpoint, total_steps, log
        self.interval, self.timeout = interval, timeout
        self.step, self.values, self.eval_loss, self.checkpoint = 0, {}, None, None
        self._last_sent = -float("inf")
        self._token, self._token_read = None, -float("inf")
        self._failing, self._warned, self.sent = False, False, 0  # sent: reports the server took
        self._pending: dict | None = None
        self._closing = False
        self._wake = threading.Condition()
        self._thread = None
        if endpoint is not None:
            self._thread = threading.Thread(
                target=self._send_loop, name="trainjob-progress", daemon=True
            )
            self._thread.start()
            log.info(
                "TrainJob progress: reporting to %s at most every %g s", endpoint.url, interval
            )

    def __bool__(self) -> bool:
        return self.endpoint is not None

    def __enter__(self) -> TrainJobProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop(wait=0.0)

    def log(self, step: int, values: dict[str, float], split: str = "train") -> None:
        """MetricsSink: keep the newest values; hand a report to the sender when one is due."""
        if self.endpoint is None:
            return
        if split == "eval":
            self.eval_loss = values.get("loss")
            return
        self.step, self.values = step, dict(values)
        if time.monotonic() - self._last_sent >= self.interval:
            self._hand_over(self._status(finished=False))

    def note_checkpoint(self, path: Path | None) -> None:
        self.checkpoint = path

    def finish(self, step: int, finished: bool) -> None:
        """The last report (100% when the run finished), waited for at most `timeout` s."""
        if self.endpoint is None:
            return
        self.step = step
        self._hand_over(self._status(finished))
        self._stop(wait=self.timeout)

    def _status(self, finished: bool) -> dict:
        return trainer_status(
            self.step,
            self.total_steps,
            self.values,
            eval_loss=self.eval_loss,
            checkpoint=self.checkpoint,
            finished=finished,
            now=datetime.now(UTC),
        )

    def _hand_over(self, status: dict) -> None:
        self._last_sent = time.monotonic()
        with self._wake:
            self._pending = status  # a report not sent yet is replaced by the newer one
            self._wake.notify()

    def _stop(self, wait: float) -> None:
        if self._thread is None:
            return
        with self._wake:
            self._closing = True
            self._wake.notify()
        # a daemon thread: one still blocked on the server dies with the process
        self._thread.join(wait)
        self._thread = None

    def _send_loop(self) -> None:
        while True:
            with self._wake:
                self._wake.wait_for(lambda: self._pending is not None or self._closing)
                status, self._pending = self._pending, None
            if status is None:
                return
            self._send(status)

    def _send(self, status: dict) -> None:
        try:
            self._post({"trainerStatus": status})
        except ReportError as e:
            self._note_failure(str(e))
            return
        self.sent += 1
        if self._failing:
            self.logger.info("TrainJob progress: %s takes reports again", self.endpoint.url)
        self._failing = False

    def _note_failure(self, why: str) -> None:
        self._failing = True
        if self._warned:
            self.logger.debug("TrainJob progress: report failed again: %s", why)
            return
        self._warned = True
        self.logger.warning(
            "TrainJob progress: %s did not take the report: %s; training goes on, and reports "
            "are retried every %g s without further warnings",
            self.endpoint.url,
            why,
            self.interval,
        )

    def _post(self, payload: dict) -> None:
        try:
            request = urllib.request.Request(
                self.endpoint.url,
                data=json.dumps(payload).encode(),
                method="POST",
                headers={
                    "Authorization": f"Bearer {self._read_token()}",
                    "Content-Type": "application/json",
                },
            )
            with urllib.request.urlopen(
                request, timeout=self.timeout, context=self._ssl_context()
            ) as r:
                r.read()
        except urllib.error.HTTPError as e:
            if e.code == 403:  # the token may have rotated: read it again for the next report
                self._token = None
            raise ReportError(f"HTTP {e.code} {e.reason}: {_server_message(e)}") from None
        except urllib.error.URLError as e:
            raise ReportError(f"no answer ({e.reason})") from None
        # timeout, reset, unreadable token or CA file
        except (OSError, ssl.SSLError, ValueError) as e:
            raise ReportError(f"{type(e).__name__}: {e}") from None

    def _read_token(self) -> str:
        if self._token is None or time.monotonic() - self._token_read > TOKEN_MAX_AGE_S:
            if self.endpoint.token_file is None:
                raise ReportError(f"{ENV_TOKEN} is not set: no token to send")
            self._token = Path(self.endpoint.token_file).read_text().strip()
            self._token_read = time.monotonic()
        return self._token

    def _ssl_context(self) -> ssl.SSLContext:
        # built for each report: a report costs one TLS handshake anyway, and a CA file the
        # controller rotated is read again
        return ssl.create_default_context(cafile=self.endpoint.ca_cert)


def _server_message(e: urllib.error.HTTPError) -> str:
    """The message of the server's metav1.Status answer, or the start of whatever it sent."""
    body = e.read().decode(errors="replace")
    try:
        return str(json.loads(body).get("message") or body[:200])
    except (ValueError, AttributeError):
        return body[:200] or "(no body)"


def build_trainjob_progress(
    is_main: bool, total_steps: int, log: logging.Logger, environ: Mapping[str, str] = os.environ
) -> TrainJobProgress:
    """Global rank 0's reporter inside a Kubeflow TrainJob; one that does nothing elsewhere."""
    return TrainJobProgress(endpoint_from_environ(environ) if is_main else None, total_steps, log)
