"""lockstep/train/trainjob_progress.py against a local HTTPS status server that checks what Kubeflow
Trainer's does (pkg/statusserver/server.go and the TrainerStatus CRD rules): the POST path, the
bearer token from the token file, TLS signed by the CA file, and a payload that decodes into
TrainerStatus. transformers' own KubeflowCallback talks to the same server, so its checks are
Kubeflow's contract as HF reads it, not lockstep's. Then real tiny runs in this process report
through it, to a server that takes the reports and to one that refuses them.
"""

from __future__ import annotations

import datetime
import http.server
import ipaddress
import json
import logging
import re
import socket
import ssl
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import SimpleNamespace

import pytest

from lockstep.train.trainjob_progress import (
    ENV_CA_CERT,
    ENV_TOKEN,
    ENV_URL,
    INT32_MAX,
    Endpoint,
    TrainJobProgress,
    build_trainjob_progress,
    endpoint_from_environ,
    trainer_status,
)

from .tiny import tiny_config, train

NAMESPACE, JOB = "team-a", "gpt-small"
STATUS_PATH = f"/apis/trainer.kubeflow.org/v1alpha1/namespaces/{NAMESPACE}/trainjobs/{JOB}/status"
# metav1.Time decodes with time.RFC3339: a date, a time, optional fractional seconds, Z or an offset
RFC3339 = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})")
LOG = logging.getLogger("lockstep.test.trainjob")


# ---------------------------------------------------------------------- a CA, a server certificate


def _name(common: str):
    from cryptography import x509
    from cryptography.x509.oid import NameOID

    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _certificate(subject: str, key, issuer: str, issuer_key, ca: bool, hosts: list[str] = ()):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes

    now = datetime.datetime.now(datetime.UTC)
    builder = (
        x509.CertificateBuilder()
        .subject_name(_name(subject))
        .issuer_name(_name(issuer))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(hours=1))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
    )
    if ca:
        builder = builder.add_extension(
            x509.KeyUsage(
                digital_signature=True,
                key_cert_sign=True,
                crl_sign=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        builder = builder.add_extension(
            x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
        )
    else:
        builder = builder.add_extension(
            x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address(h)) for h in hosts]),
            critical=False,
        )
        builder = builder.add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(issuer_key.public_key()),
            critical=False,
        )
    return builder.sign(issuer_key, hashes.SHA256())


@pytest.fixture(scope="module")
def pki(tmp_path_factory) -> SimpleNamespace:
    """The controller's CA and the server certificate it signed (for 127.0.0.1), and another CA."""
    pytest.importorskip("cryptography")
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    out = tmp_path_factory.mktemp("pki")
    pem = serialization.Encoding.PEM

    def new_ca(name: str):
        key = ec.generate_private_key(ec.SECP256R1())
        cert = _certificate(name, key, name, key, ca=True)
        (out / f"{name}.crt").write_bytes(cert.public_bytes(pem))
        return key

    ca_key = new_ca("trainer-ca")
    new_ca("other-ca")
    key = ec.generate_private_key(ec.SECP256R1())
    cert = _certificate("trainer-status", key, "trainer-ca", ca_key, ca=False, hosts=["127.0.0.1"])
    (out / "server.crt").write_bytes(cert.public_bytes(pem))
    (out / "server.key").write_bytes(
        key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return SimpleNamespace(
        ca=out / "trainer-ca.crt",
        other_ca=out / "other-ca.crt",
        cert=out / "server.crt",
        key=out / "server.key",
    )


# ----------------------------------------------------------------------------- the status server


def payload_problem(body: bytes) -> str | None:
    """Why Trainer's server would answer 422: what Go's json decoder refuses in an
    UpdateTrainJobStatusRequest, and what the CRD's validation refuses; None for a valid one."""
    try:
        doc = json.loads(body)
    except ValueError as e:
        return f"Invalid payload: {e}"
    if not isinstance(doc, dict):
        return "Invalid payload: not an object"
    status = doc.get("trainerStatus")
    if status is None:
        return None  # answered 200, nothing applied
    if not isinstance(status, dict):
        return "Invalid payload: trainerStatus is not an object"
    for key, top in (("progressPercentage", 100), ("estimatedRemainingSeconds", INT32_MAX)):
        value = status.get(key)
        if value is not None and type(value) is not int:  # 45.0, "45", true: no int32
            return f"Invalid payload: {key} {value!r} is not an int32"
        if value is not None and not 0 <= value <= top:
            return f"trainerStatus.{key}: Invalid value: {value}: must be in [0, {top}]"
    metrics = status.get("metrics") or []
    if not isinstance(metrics, list):
        return "Invalid payload: metrics is not a list"
    if len(metrics) > 256:
        return f"trainerStatus.metrics: Too many: {len(metrics)}: must have at most 256 items"
    for m in metrics:
        for field in ("name", "value"):
            text = m.get(field) if isinstance(m, dict) else None
            if not isinstance(text, str):
                return f"Invalid payload: metric {field} {text!r} is not a string"
            if not 1 <= len(text) <= 64:
                return f"trainerStatus.metrics.{field}: Invalid value: {text!r}: 1-64 characters"
    when = status.get("lastUpdatedTime")
    if not when:
        return "trainerStatus: lastUpdatedTime is required when trainerStatus is present"
    if not isinstance(when, str) or not RFC3339.fullmatch(when):
        return f"Invalid payload: lastUpdatedTime {when!r} is not RFC 3339"
    return None


def k8s_status(message: str, reason: str, code: int) -> dict:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


class StatusServer:
    """Kubeflow Trainer's status endpoint for one TrainJob, over HTTPS with the test CA's cert.

    `token` is the one it accepts; `delay` holds each answer back (a server that hangs); `refuse`
    (code, message, reason) answers every valid request so, as when the API server refuses to
    apply it. It keeps every answer's code and every status it took."""

    def __init__(self, pki: SimpleNamespace, token: str):
        self.token, self.delay, self.refuse = token, 0.0, None
        self.codes: list[int] = []
        self.taken: list[dict] = []
        self.done = threading.Condition()
        server = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                time.sleep(server.delay)
                code, answer = server.answer(self.path, self.headers.get("Authorization", ""), body)
                data = json.dumps(answer).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                with server.done:
                    server.codes.append(code)
                    server.done.notify_all()

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request, client_address) -> None:
                pass  # a client that refused our certificate: its side says so

        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(pki.cert, pki.key)
        self.http = Server(("127.0.0.1", 0), Handler)
        self.http.socket = context.wrap_socket(self.http.socket, server_side=True)
        self.url = f"https://127.0.0.1:{self.http.server_address[1]}{STATUS_PATH}"
        self.thread = threading.Thread(target=self.http.serve_forever, args=(0.05,), daemon=True)
        self.thread.start()

    def answer(self, path: str, authorization: str, body: bytes) -> tuple[int, dict]:
        if path != STATUS_PATH:
            return 404, k8s_status("Not found", "NotFound", 404)
        parts = authorization.split()
        if len(parts) != 2 or parts[0].lower() != "bearer" or parts[1] != self.token:
            return 403, k8s_status("Forbidden", "Forbidden", 403)
        problem = payload_problem(body)
        if problem:
            return 422, k8s_status(problem, "Invalid", 422)
        if self.refuse:
            code, message, reason = self.refuse
            return code, k8s_status(message, reason, code)
        payload = json.loads(body)
        if payload.get("trainerStatus") is not None:
            self.taken.append(payload["trainerStatus"])
        return 200, payload

    def wait_for(self, answers: int) -> None:
        with self.done:
            assert self.done.wait_for(lambda: len(self.codes) >= answers, timeout=30), self.codes

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()


@pytest.fixture
def server(pki, tmp_path):
    token_file = tmp_path / "token"
    token_file.write_text("token-1\n")
    s = StatusServer(pki, "token-1")
    s.token_file, s.ca = token_file, pki.ca
    yield s
    s.close()


def post(server: StatusServer, body: bytes, token: str = "token-1", path: str = STATUS_PATH):
    """(code, answer) of one raw POST, as the Kubeflow user guide's "raw HTTP" client sends it."""
    url = server.url.replace(STATUS_PATH, path)
    request = urllib.request.Request(
        url, data=body, method="POST", headers={"Authorization": f"Bearer {token}"}
    )
    context = ssl.create_default_context(cafile=server.ca)
    try:
        with urllib.request.urlopen(request, timeout=10, context=context) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def valid_status(**changes) -> dict:
    status = {
        "progressPercentage": 45,
        "estimatedRemainingSeconds": 120,
        "metrics": [{"name": "loss", "value": "0.15"}],
        "lastUpdatedTime": "2026-06-12T03:00:00Z",
    }
    return {**status, **changes}


# ------------------------------------------------------------------------- the server is Trainer's


@pytest.mark.parametrize(
    "status, message",
    [
        (valid_status(progressPercentage=101), "must be in [0, 100]"),
        (valid_status(progressPercentage=45.0), "is not an int32"),
        (valid_status(estimatedRemainingSeconds=-1), "must be in [0, 2147483647]"),
        (valid_status(estimatedRemainingSeconds=INT32_MAX + 1), "must be in [0, 2147483647]"),
        (valid_status(metrics=[{"name": "loss", "value": 0.15}]), "is not a string"),
        (valid_status(metrics=[{"name": "checkpoint", "value": "x" * 65}]), "1-64 characters"),
        (valid_status(metrics=[{"name": "", "value": "1"}]), "1-64 characters"),
        (
            valid_status(metrics=[{"name": f"m{i}", "value": "1"} for i in range(257)]),
            "at most 256",
        ),
        (
            {k: v for k, v in valid_status().items() if k != "lastUpdatedTime"},
            "lastUpdatedTime is required",
        ),
        (valid_status(lastUpdatedTime="2026-06-12 03:00:00"), "is not RFC 3339"),
    ],
)
def test_the_server_refuses_what_trainer_refuses_with_422(server, status, message):
    code, answer = post(server, json.dumps({"trainerStatus": status}).encode())
    assert code == 422 and answer["reason"] == "Invalid" and message in answer["message"]
    assert server.taken == []


def test_the_server_takes_the_user_guides_payload_and_checks_token_and_path(server):
    body = json.dumps({"trainerStatus": valid_status()}).encode()
    assert post(server, body) == (200, {"trainerStatus": valid_status()})
    code, answer = post(server, body, token="someone-else")
    assert (code, answer["message"], answer["code"]) == (403, "Forbidden", 403)
    assert post(server, body, path=STATUS_PATH.replace(JOB, "other-job"))[0] == 404
    assert server.taken == [valid_status()]


def test_hf_kubeflow_callback_is_taken_by_the_same_server(server, tmp_path, monkeypatch):
    """transformers' own client, driven through a run's callbacks with its real state objects."""
    transformers = pytest.importorskip("transformers")
    from transformers.integrations.integration_utils import KubeflowCallback

    monkeypatch.setenv(ENV_URL, server.url)
    monkeypatch.setenv(ENV_CA_CERT, str(server.ca))
    monkeypatch.setenv(ENV_TOKEN, str(server.token_file))
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "hf"), report_to="none")
    state = transformers.TrainerState(max_steps=4, is_world_process_zero=True)
    control = transformers.TrainerControl()
    callback = KubeflowCallback()
    callback._MIN_UPDATE_INTERVAL = 0.0  # HF's 5 s throttle: every step reports here
    callback.on_train_begin(args, state, control)
    for step in range(1, 5):
        state.global_step, state.epoch = step, step / 2
        callback.on_log(
            args,
            state,
            control,
            logs={
                "loss": 3.0 - step / 4,
                "learning_rate": 1e-3,
                "grad_norm": 0.5,
                "epoch": step / 2,
            },
        )
        callback.on_step_end(args, state, control)
    callback.on_train_end(args, state, control)

    server.wait_for(6)
    # HF's client swallows failures: the server's side is the proof
    assert server.codes == [200] * 6
    assert [s["progressPercentage"] for s in server.taken] == [0, 25, 50, 75, 99, 100]
    last = {m["name"]: m["value"] for m in server.taken[-1]["metrics"]}
    assert last["loss"] == "2.0" and last["learning_rate"] == "0.001"
    assert {m["name"]: m["value"] for m in server.taken[-2]["metrics"]}["current_step"] == "4"


# ----------------------------------------------------------------------------- what lockstep sends


def metrics_of(status: dict) -> dict[str, str]:
    return {m["name"]: m["value"] for m in status["metrics"]}


def test_trainer_status_mid_run_at_the_end_and_with_a_long_checkpoint_name():
    now = datetime.datetime(2026, 11, 25, 21, 40, 5, 123456, tzinfo=datetime.UTC)
    values = {
        "loss": 2.345678,
        "lr": 3e-4,
        "grad_norm": 0.8,
        "tokens_per_s": 10234.5,
        "epoch": 0.375,
        "epochs": 1.0,
        "eta_s": 191.6,
    }
    ckpt = Path("/data/runs/a-long-run-name/checkpoints/step_00000002")
    mid = trainer_status(3, 8, values, 2.5, ckpt, finished=False, now=now)
    assert mid["progressPercentage"] == 37 and mid["estimatedRemainingSeconds"] == 192
    assert mid["lastUpdatedTime"] == "2026-11-25T21:40:05Z"
    assert metrics_of(mid) == {
        "loss": "2.34568",
        "learning_rate": "0.0003",
        "tokens_per_s": "10234.5",
        "epoch": "0.375",
        "epochs": "1",
        "eval_loss": "2.5",
        "current_step": "3",
        "total_steps": "8",
        "checkpoint_step": "2",
        "checkpoint": "step_00000002",
    }

    at_last_step = trainer_status(8, 8, values, None, None, finished=False, now=now)
    assert at_last_step["progressPercentage"] == 99  # 100 only once the run finished
    end = trainer_status(8, 8, values, None, ckpt, finished=True, now=now)
    assert (end["progressPercentage"], end["estimatedRemainingSeconds"]) == (100, 0)
    first = trainer_status(0, 8, {}, None, None, finished=False, now=now)
    # no step yet, no rate: no ETA
    assert first["progressPercentage"] == 0 and "estimatedRemainingSeconds" not in first
    huge = trainer_status(1, 10**9, {"eta_s": 1e12}, None, None, finished=False, now=now)
    assert huge["estimatedRemainingSeconds"] == INT32_MAX
    long = trainer_status(1, 8, {}, None, Path("checkpoint-" + "9" * 80), finished=False, now=now)
    assert metrics_of(long)["checkpoint"] == "9" * 64  # an HF Trainer directory: its tail, no step
    assert "checkpoint_step" not in metrics_of(long)
    for status in (mid, end, first, huge, long):
        assert payload_problem(json.dumps({"trainerStatus": status}).encode()) is None


def test_the_environment_decides_whether_and_where_to_report():
    env = {ENV_URL: "https://trainer:10443/x", ENV_CA_CERT: "/ca.crt", ENV_TOKEN: "/token"}
    assert endpoint_from_environ(env) == Endpoint("https://trainer:10443/x", "/ca.crt", "/token")
    assert endpoint_from_environ({}) is None
    assert endpoint_from_environ({**env, "DISABLE_KUBEFLOW_INTEGRATION": "true"}) is None
    assert not build_trainjob_progress(is_main=False, total_steps=4, log=LOG, environ=env)
    assert not build_trainjob_progress(is_main=True, total_steps=4, log=LOG, environ={})


def reporter(
    server: StatusServer, ca: Path | None = None, url: str | None = None, timeout: float = 5.0
) -> TrainJobProgress:
    endpoint = Endpoint(url or server.url, str(ca or server.ca), str(server.token_file))
    return TrainJobProgress(endpoint, total_steps=4, log=LOG, interval=0.0, timeout=timeout)


def test_each_report_is_taken_and_a_rotated_token_is_read_again(server, caplog):
    caplog.set_level(logging.DEBUG, LOG.name)
    with reporter(server) as progress:
        progress.log(1, {"loss": 3.0, "lr": 1e-3, "epoch": 0.25, "eta_s": 30.0})
        server.wait_for(1)
        progress.log(1, {"loss": 2.9}, split="eval")  # kept for the next report
        progress.note_checkpoint(Path("run/checkpoints/step_00000002"))
        # kubelet rotated it; the server takes only the new one
        server.token_file.write_text("token-2\n")
        server.token = "token-2"
        progress.log(2, {"loss": 2.5, "lr": 1e-3, "epoch": 0.5, "eta_s": 20.0})
        server.wait_for(2)
        progress.log(3, {"loss": 2.0, "lr": 1e-3, "epoch": 0.75, "eta_s": 10.0})
        server.wait_for(3)
        progress.finish(4, finished=True)
    assert server.codes == [200, 403, 200, 200]  # the cached token, then the file read again
    assert [s["progressPercentage"] for s in server.taken] == [25, 75, 100]
    assert [s["estimatedRemainingSeconds"] for s in server.taken] == [30, 10, 0]
    last = metrics_of(server.taken[-1])
    assert (last["eval_loss"], last["checkpoint_step"], last["loss"]) == ("2.9", "2", "2")
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "HTTP 403 Forbidden: Forbidden" in warnings[0]
    assert any("takes reports again" in r.getMessage() for r in caplog.records)
    assert progress.sent == 3


def closed_port_url() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"https://127.0.0.1:{port}{STATUS_PATH}"


@pytest.mark.parametrize(
    "failure, expected",
    [
        ("down", "Connection refused"),
        ("unknown CA", "CERTIFICATE_VERIFY_FAILED"),
        ("422", "HTTP 422 Unprocessable Entity: TrainJob.trainer.kubeflow.org is invalid"),
        ("hangs", "timed out"),
    ],
)
def test_a_failing_server_costs_one_warning_and_reports_go_on(
    server, pki, caplog, failure, expected
):
    caplog.set_level(logging.DEBUG, LOG.name)
    progress = reporter(
        server,
        ca=pki.other_ca if failure == "unknown CA" else None,
        url=closed_port_url() if failure == "down" else None,
        timeout=0.3 if failure == "hangs" else 5.0,
    )
    server.delay = 1.0 if failure == "hangs" else 0.0
    if failure == "422":  # what the API server's validation says, passed on by Trainer's server
        server.refuse = (422, "TrainJob.trainer.kubeflow.org is invalid", "Invalid")
    with progress:
        for step in (1, 2, 3):
            progress.log(step, {"loss": 1.0, "eta_s": 5.0})
            # the sender's turn: each report is tried
            time.sleep(0.05 if failure != "hangs" else 0.4)
        progress.finish(4, finished=False)
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and expected in warnings[0], warnings
    assert "training goes on" in warnings[0]
    retries = [r for r in caplog.records if "report failed again" in r.getMessage()]
    assert retries and all(r.levelno == logging.DEBUG for r in retries)
    assert progress.sent == 0


# ------------------------------------------------------------------------- real runs in a TrainJob


def in_trainjob(monkeypatch, server: StatusServer) -> None:
    monkeypatch.setenv(ENV_URL, server.url)
    monkeypatch.setenv(ENV_CA_CERT, str(server.ca))
    monkeypatch.setenv(ENV_TOKEN, str(server.token_file))


def test_a_run_reports_progress_to_100_with_eta_loss_and_the_committed_checkpoint(
    server, monkeypatch, tmp_path, corpus, token_cache
):
    in_trainjob(monkeypatch, server)
    run = tmp_path / "run"
    steps = {"train.max_steps": 4, "checkpoint.save_interval": 2}
    result = train(tiny_config(run, corpus, token_cache, **steps))
    assert result.step == 4
    server.wait_for(2)
    assert set(server.codes) == {200}
    percents = [s["progressPercentage"] for s in server.taken]
    assert percents == sorted(percents) and percents[0] < 100 and percents[-1] == 100
    assert percents.count(100) == 1
    first, last = server.taken[0], server.taken[-1]
    assert first["estimatedRemainingSeconds"] >= 0 and last["estimatedRemainingSeconds"] == 0
    assert float(metrics_of(first)["loss"]) > 4.0  # ~ln(256) for an untrained byte model
    end = metrics_of(last)
    assert (end["current_step"], end["total_steps"], end["checkpoint_step"]) == ("4", "4", "4")
    assert end["checkpoint"] == "step_00000004" and "eval_loss" in end
    assert "epochs" not in end  # a run bound by steps
    assert "TrainJob progress: reporting to" in (run / "logs" / "rank0.log").read_text()


def test_a_run_whose_reports_are_refused_finishes_with_one_warning(
    server, monkeypatch, tmp_path, corpus, token_cache
):
    in_trainjob(monkeypatch, server)
    server.token = "the-controller-wants-another"
    run = tmp_path / "run"
    # warmup_steps 1: no warning that warmup outlasts the run
    result = train(tiny_config(run, corpus, token_cache, **{"optim.warmup_steps": 1}))
    assert result.step == 3 and result.checkpoint == run / "checkpoints" / "step_00000003"
    server.wait_for(2)  # the first log's report and the final one
    assert set(server.codes) == {403} and server.taken == []
    log = (run / "logs" / "rank0.log").read_text()
    warnings = [line for line in log.splitlines() if "WARNING" in line]
    assert len(warnings) == 1 and "HTTP 403 Forbidden: Forbidden" in warnings[0], warnings
