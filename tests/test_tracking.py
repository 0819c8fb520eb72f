"""Experiment tracking (train.report_to): what TensorBoard, wandb and trackio hold after a run, read
back with each tool's own reader (tensorboard's event accumulator, wandb's offline run file, trackio's
local store), against metrics.jsonl, eval.jsonl and config.toml; a --resume continuing the same
tracker run; no connection off the machine; a missing package, an unknown name, and a tracker that
fails mid-run.

One run of the embedded model (3 steps, then --resume to 5) reports to all three, in a subprocess
whose Python sockets refuse any address but the machine's own.
"""

import json
import math
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from rlcore import ConfigError, RlcoreWarning
from test_train import SMALL, config, rows

if sys.version_info >= (3, 11):
    import tomllib
else:  # Python 3.10
    import tomli as tomllib

pytestmark = pytest.mark.usefixtures("embedded_dir")  # conftest: the embedded model, one torch thread

# a sitecustomize for the run's process: a connection (or name lookup) off the machine is refused and noted
NO_NETWORK = """
import os, socket

LOCAL = ("127.0.0.1", "::1", "localhost", "0.0.0.0")
real_connect, real_connect_ex, real_getaddrinfo = socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo


def refuse(address):
    with open(os.environ["NETWORK_LOG"], "a") as f:
        f.write(repr(address) + "\\n")
    raise OSError("this test allows no network")


def connect(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOCAL:
        refuse(address)
    return real_connect(self, address)


def connect_ex(self, address):
    if self.family in (socket.AF_INET, socket.AF_INET6) and address[0] not in LOCAL:
        refuse(address)
    return real_connect_ex(self, address)


def getaddrinfo(host, *args, **kwargs):
    if host not in LOCAL and host is not None:
        refuse(host)
    return real_getaddrinfo(host, *args, **kwargs)


socket.socket.connect, socket.socket.connect_ex, socket.getaddrinfo = connect, connect_ex, getaddrinfo
"""

TRACKED = ["train.report_to=['tensorboard', 'wandb', 'trackio']", "train.run_name=my-run", "train.eval_steps=2",
           "train.max_steps=3"]


def tracked_env(tmp: Path) -> dict:
    """The run's environment: the trackers' stores under `tmp`, no WANDB_* setting of the user's, and
    the no-network sitecustomize first on the path."""
    (tmp / "site").mkdir(exist_ok=True)
    (tmp / "site" / "sitecustomize.py").write_text(NO_NETWORK)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRACKIO_"))}
    return {**env, "TRACKIO_DIR": str(tmp / "trackio"), "WANDB_CONFIG_DIR": str(tmp / "wandb-config"),
            "WANDB_CACHE_DIR": str(tmp / "wandb-cache"), "WANDB_DATA_DIR": str(tmp / "wandb-data"),
            "NETWORK_LOG": str(tmp / "network.log"),
            "PYTHONPATH": os.pathsep.join([str(tmp / "site"), str(Path(__file__).parent), *sys.path])}


def rlcore_train(tmp: Path, env: dict, *args: str) -> None:
    out = subprocess.run([sys.executable, "-m", "rlcore.cli", "train", *args], cwd=tmp, env=env, capture_output=True,
                         text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]


@pytest.fixture(scope="module")
def tracked(embedded_dir, tmp_path_factory):
    """The run directory of a run that reported to every tracker, and its environment."""
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    pytest.importorskip("wandb", reason="the wandb extra")
    pytest.importorskip("trackio", reason="the trackio extra")
    tmp = tmp_path_factory.mktemp("tracked")
    run, env = tmp / "run", tracked_env(tmp)
    sets = [a for o in [*SMALL, f"train.output_dir={run}", *TRACKED] for a in ("--set", o)]
    rlcore_train(tmp, env, *sets)
    rlcore_train(tmp, env, "--resume", str(run), "--set", "train.max_steps=5")
    return run, env


def expected(run: Path) -> dict[int, dict]:
    """What every tracker should hold: each step's metrics row and evaluation (eval.jsonl), keyed by step,
    without `step` itself (the x axis) and without the None a non-finite value is written as."""
    want: dict[int, dict] = {}
    for row in rows(run) + [json.loads(ln) for ln in (run / "eval.jsonl").read_text().splitlines()]:
        want.setdefault(row["step"], {}).update({k: v for k, v in row.items() if k != "step" and v is not None})
    return want


def test_the_run_made_no_connection_off_the_machine(tracked):
    run, env = tracked
    assert not Path(env["NETWORK_LOG"]).exists(), Path(env["NETWORK_LOG"]).read_text()
    assert sorted(expected(run)) == [0, 1, 2, 3, 4, 5]  # both runs, evaluations at 0, 2, 3 (the end), 4 and 5


def test_tensorboard_holds_every_metric_and_evaluation_at_its_step(tracked):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run, _ = tracked
    events = EventAccumulator(str(run / "tensorboard"))
    events.Reload()
    got: dict[int, dict] = {}
    for tag in events.Tags()["scalars"]:
        for event in events.Scalars(tag):
            assert tag not in got.get(event.step, {}), f"{tag} twice at step {event.step}"
            got.setdefault(event.step, {})[tag] = event.value
    want = expected(run)
    assert got.keys() == want.keys()
    for step, values in want.items():
        assert got[step] == pytest.approx({k: float(v) for k, v in values.items()}, rel=1e-6), step  # float32
    # the name and config at the step the run started from, 0, and the one its --resume did, 3
    names, texts = events.Tensors("run_name/text_summary"), events.Tensors("config/text_summary")
    assert [(e.step, e.tensor_proto.string_val) for e in names] == [(0, [b"my-run"]), (3, [b"my-run"])]
    assert [e.step for e in texts] == [0, 3]
    toml = texts[-1].tensor_proto.string_val[0].decode().removeprefix("```toml\n").removesuffix("```")
    assert tomllib.loads(toml) == tomllib.loads((run / "config.toml").read_text())


def wandb_records(file: Path) -> list:
    """The records of a wandb offline run file (run-<id>.wandb): W&B's log format, LevelDB's record log
    (a 7-byte file header, then records of a 7-byte header (crc32, length, type: full, first, middle,
    last) and data, in 32 KiB blocks), each a protobuf Record."""
    from wandb.proto import wandb_internal_pb2

    data, records, part, pos = file.read_bytes(), [], b"", 7
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        left = 32768 - pos % 32768
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        part += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # full, or last
            record = wandb_internal_pb2.Record()
            record.ParseFromString(part)
            records.append(record)
            part = b""
    return records


def test_wandb_has_one_offline_run_with_every_metric_the_config_and_the_name(tracked):
    run, _ = tracked
    files = sorted((run / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 2  # the first run and its --resume: one wandb run, its id in both
    got, runs = {}, []
    for file in files:
        for record in wandb_records(file):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                runs.append(record.run)
            elif kind == "history":
                items = {item.key or "/".join(item.nested_key): json.loads(item.value_json)
                         for item in record.history.item}
                got.setdefault(items.pop("_step"), {}).update(
                    {k: v for k, v in items.items() if not k.startswith("_") and v is not None})
    assert [(r.run_id, r.display_name, r.project) for r in runs] == [(runs[0].run_id, "my-run", "huggingface")] * 2
    assert files[0].name == f"run-{runs[0].run_id}.wandb"
    want = expected(run)
    assert got.keys() == want.keys()
    for step, values in want.items():
        assert got[step] == pytest.approx(values, rel=1e-12), step
    recorded = tomllib.loads((run / "config.toml").read_text())
    config = {u.key: json.loads(u.value_json) for u in runs[-1].config.update if u.key in recorded}
    assert config == {section: {**{k: None for k in config[section]}, **values} for section, values in recorded.items()}


def test_trackio_has_one_local_run_with_every_metric_the_config_and_the_name(tracked):
    run, env = tracked
    code = ("import json, trackio\n"
            "from trackio.sqlite_storage import SQLiteStorage as s\n"
            "print(json.dumps([s.get_runs('huggingface'), s.get_logs('huggingface', 'my-run'), "
            "s.get_run_config('huggingface', 'my-run')]))")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    runs, logs, config = json.loads(out.stdout.strip().splitlines()[-1])
    assert runs == ["my-run"]  # the --resume continued it
    got: dict[int, dict] = {}
    for entry in logs:
        got.setdefault(entry.pop("step"), {}).update(
            {k: v for k, v in entry.items() if k != "timestamp" and v is not None})
    want = expected(run)
    assert got.keys() == want.keys()
    for step, values in want.items():
        assert got[step] == pytest.approx(values, rel=1e-12), step
    recorded = tomllib.loads((run / "config.toml").read_text())
    assert {section: {k: v for k, v in config[section].items() if v is not None} for section in recorded} == recorded


def test_report_to_none_starts_no_tracker(tmp_path):
    from rlcore.run.tracking import Trackers

    trackers = Trackers.open("none", tmp_path, "run", {}, "", "huggingface")
    trackers.log({"loss": 1.0}, 1)
    trackers.close()
    assert trackers.trackers == {} and list(tmp_path.iterdir()) == []


def test_an_unknown_tracker_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match=r"train.report_to = \['wandb', 'mlflow'\]: rlcore reports to tensorboard, "
                                          r"wandb, trackio \(a name or a list of them\), or 'none'"):
        config(tmp_path / "run", "train.report_to=['wandb', 'mlflow']")


def test_a_tracker_not_installed_is_an_error_at_setup_naming_its_extra(tmp_path, monkeypatch):
    from rlcore.train import train

    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    with pytest.raises(ImportError, match=r"train.report_to names 'wandb', which is not installed .*: pip install -e "
                                          r"\"\.\[wandb\]\" \(or pip install wandb\)"):
        train(config(tmp_path / "run", "train.report_to=wandb"))
    assert not (tmp_path / "run").exists()


def test_a_tracker_that_raises_mid_run_is_a_warning_and_the_run_goes_on(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard", reason="the tensorboard extra")
    from rlcore.run import tracking
    from rlcore.train import train

    real_log = tracking.TensorBoard.log

    def log(self, values, step):
        if step == 2 and "loss" in values:
            raise ConnectionError("disk full")
        real_log(self, values, step)

    monkeypatch.setattr(tracking.TensorBoard, "log", log)
    run = tmp_path / "run"
    with pytest.warns(RlcoreWarning, match=r"train.report_to 'tensorboard' raised ConnectionError at step 2: disk "
                                           r"full; it gets no more of this run, which goes on"):
        train(config(run, "train.report_to=tensorboard", "train.max_steps=3"))
    assert [r["step"] for r in rows(run)] == [1, 2, 3]
    assert all(math.isfinite(r["loss"]) for r in rows(run))


def test_a_tracker_that_cannot_start_is_an_error_naming_it(tmp_path, monkeypatch):
    from rlcore.run import tracking

    class NoKey:
        def __init__(self, *args):
            raise ValueError("no API key configured")

    monkeypatch.setitem(tracking.TRACKER_CLASSES, "wandb", NoKey)
    with pytest.raises(RuntimeError, match=r"train.report_to 'wandb' could not start its run \(ValueError: no API key "
                                           r"configured\); fix that, or drop 'wandb' from train.report_to"):
        tracking.Trackers.open("wandb", tmp_path, "run", {}, "", "huggingface")
