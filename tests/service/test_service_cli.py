"""Job files, the control plane and the CLI's error paths (no Ray needed)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from _ray_service import JOB_SCRIPT

from stratagem.cli import main
from stratagem.errors import StratagemError
from stratagem.service import store as st
from stratagem.service.api import SERVICE_FILE, ControlServer, ServiceClient
from stratagem.service.jobfile import load_job_file, parse_job


def write(tmp: Path, text: str) -> Path:
    path = tmp / "job.yaml"
    path.write_text(text)
    return path


GOOD = f"name: a\nscript: {JOB_SCRIPT}\nargs: [--epochs, 2]\nmin_replicas: 1\nmax_replicas: 2\n"


def test_a_job_file_parses_into_a_frozen_spec(tmp_path):
    spec = load_job_file(write(tmp_path, GOOD + "resources: {CPU: 2, GPU: 1}\n"
                               "checkpoint_dir: ck\npreemptible: false\n"))
    assert spec.args == ("--epochs", "2") and spec.max_replicas == 2
    assert dict(spec.resources) == {"CPU": 2.0, "GPU": 1.0} and not spec.preemptible
    assert spec.checkpoint_dir == str((tmp_path / "ck").resolve())
    assert parse_job(spec.to_dict()) == spec  # what the client sends, the server rebuilds
    with pytest.raises(AttributeError):
        spec.name = "b"  # type: ignore[misc]


@pytest.mark.parametrize("extra, field, fix", [
    ("max_replicas: 0\n", "max_replicas", "whole number"),
    ("min_replicas: 3\n", "max_replicas", "max_replicas >= min_replicas"),
    ("adaptive: yes please\n", "adaptive", "true or false"),
    ("resources: {GPU: -1}\n", "resources", "resources: {CPU: 1, GPU: 1}"),
    ("replicas: 2\n", "replicas", "the fields are"),
    ("env: {'1BAD': x}\n", "env", "variable names"),
])
def test_bad_job_files_name_the_field_and_the_fix(tmp_path, extra, field, fix):
    key = extra.split(":")[0]  # replaces GOOD's line (a key written twice is refused)
    text = "".join(line for line in GOOD.splitlines(True) if not line.startswith(key))
    with pytest.raises(StratagemError) as err:
        load_job_file(write(tmp_path, text + extra))
    assert f"field '{field}'" in err.value.where and fix in err.value.render()


def test_bad_names_scripts_and_yaml(tmp_path):
    for text, needle in [("name: 'a b'\nscript: x.py\n", "field 'name'"),
                         ("name: a\nscript: missing.py\n", "field 'script'"),
                         ("name: a\n", "field 'script'"),
                         ("name: [a\n", "malformed YAML"),
                         ("- a\n", "mapping of fields")]:
        with pytest.raises(StratagemError) as err:
            load_job_file(write(tmp_path, text))
        assert needle in err.value.render(), text
    with pytest.raises(StratagemError, match="cannot read"):
        load_job_file(tmp_path / "absent.yaml")


@pytest.fixture
def service(tmp_path):
    server = ControlServer(tmp_path)
    yield server
    server.close()


def test_the_control_plane_needs_its_token_and_listens_on_loopback(service, tmp_path):
    info = json.loads((tmp_path / SERVICE_FILE).read_text())
    assert info["host"] == "127.0.0.1" and (tmp_path / SERVICE_FILE).stat().st_mode & 0o077 == 0
    req = urllib.request.Request(f"http://127.0.0.1:{info['port']}/jobs",
                                 headers={"Authorization": "Bearer wrong"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 401
    with pytest.raises(StratagemError, match="without a token"):
        ControlServer(tmp_path / "other", host="0.0.0.0")


def test_submit_ls_delete_through_the_api(service, tmp_path):
    client = ServiceClient(tmp_path)
    assert client.submit(write(tmp_path, GOOD)) == "a"
    with pytest.raises(StratagemError, match="already pending"):
        client.submit(write(tmp_path, GOOD))
    table = client.table()
    assert "a" in table and "pending" in table and "0/2" in table
    assert all(len(line) <= 80 for line in table.splitlines())
    assert client.delete("a") == st.PENDING
    assert st.Store(tmp_path).job("a").state == st.STOPPING


def test_a_finished_name_is_refused_unless_replaced_and_logs_show_one_run(service, tmp_path,
                                                                         capsys):
    d = ["--dir", str(tmp_path)]
    job = str(write(tmp_path, GOOD))
    assert main(["submit", job, *d]) == 0
    store = st.Store(tmp_path)
    store.update("a", "succeeded", state=st.SUCCEEDED)  # the first run ends
    logs = tmp_path / "jobs" / "a" / "logs"
    logs.mkdir(parents=True)
    (logs / "rank-0.log").write_text("output of the first run\n")
    (tmp_path / "jobs" / "a" / "ckpt").mkdir()
    capsys.readouterr()
    assert main(["submit", job, *d]) == 2  # silently mixing two runs under one name: no
    err = capsys.readouterr().err
    assert "a job named 'a' already ran (succeeded)" in err and "--replace" in err
    assert store.job("a").state == st.SUCCEEDED
    assert main(["logs", "a", *d]) == 0  # the first run is still there, whole
    assert "output of the first run" in capsys.readouterr().out
    assert main(["submit", "--replace", job, *d]) == 0
    assert capsys.readouterr().out == "submitted a\n"
    assert store.job("a").state == st.PENDING
    assert main(["logs", "a", *d]) == 0
    out = capsys.readouterr().out
    assert "first run" not in out and "succeeded" not in out
    assert out.count("submitted") == 1
    assert not (tmp_path / "jobs" / "a").exists()  # its logs and checkpoints went with it
    assert [p.name for p in (tmp_path / "jobs").iterdir()] == []
    with pytest.raises(StratagemError, match="already pending"):  # --replace: finished only
        ServiceClient(tmp_path).submit(job, replace=True)


def test_cli_error_paths(service, tmp_path, capsys):
    d = ["--dir", str(tmp_path)]
    assert main(["submit", str(write(tmp_path, "name: a\nscript: nope.py\n")), *d]) == 2
    assert "field 'script'" in capsys.readouterr().err
    assert main(["logs", "ghost", *d]) == 2
    err = capsys.readouterr().err
    assert "no job named 'ghost'" in err and "stratagem ls" in err
    assert main(["delete", "ghost", *d]) == 2
    assert main(["submit", str(write(tmp_path, GOOD)), *d]) == 0
    assert main(["ls", *d]) == 0
    assert "pending" in capsys.readouterr().out
    empty = tmp_path / "nothing"
    for argv in (["ls"], ["cluster", "status"], ["cluster", "down"], ["logs", "a"]):
        assert main([*argv, "--dir", str(empty)]) == 2, argv
        err = capsys.readouterr().err
        assert "no cluster" in err and "stratagem cluster up" in err, argv
