"""stratagem.env: one accessor per variable, read at call time, with the documented
defaults, fallbacks and deprecated aliases."""

from __future__ import annotations

import warnings
from datetime import timedelta
from pathlib import Path

import pytest

from stratagem import env
from stratagem.errors import StratagemError

ALL = [v for k, v in vars(env).items() if k.isupper() and isinstance(v, str)
       and v.startswith(("STRATAGEM_", "ADAPTDL_"))]


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [*ALL, "WORLD_SIZE", "RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE",
                 "GROUP_RANK", "TORCHELASTIC_RUN_ID", "TORCHELASTIC_RESTART_COUNT"]:
        monkeypatch.delenv(name, raising=False)


def test_one_process_group_timeout_with_its_deprecated_alias(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.pg_timeout() == timedelta(seconds=300)
    monkeypatch.setenv("STRATAGEM_PS_TIMEOUT", "42")
    with pytest.warns(DeprecationWarning, match="STRATAGEM_PG_TIMEOUT_S"):
        assert env.pg_timeout() == timedelta(seconds=42)
    monkeypatch.setenv("STRATAGEM_PG_TIMEOUT_S", "7.5")  # the current name wins
    assert env.pg_timeout() == timedelta(seconds=7.5)
    monkeypatch.setenv("STRATAGEM_PG_TIMEOUT_S", "soon")
    with pytest.raises(StratagemError, match="STRATAGEM_PG_TIMEOUT_S='soon' is not a number"):
        env.pg_timeout()


def test_parameter_server_timeout_is_the_same_setting(monkeypatch: pytest.MonkeyPatch) -> None:
    from stratagem.runtime.ps.cluster import data_timeout

    monkeypatch.setenv("STRATAGEM_PG_TIMEOUT_S", "12")
    assert data_timeout() == env.pg_timeout() == timedelta(seconds=12)


def test_checkpoint_dir_and_adaptdl_fallbacks(monkeypatch: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    assert env.checkpoint_dir() is None and env.adaptdl_checkpoint_path() is None
    monkeypatch.setenv("ADAPTDL_CHECKPOINT_PATH", str(tmp_path / "a"))
    assert env.checkpoint_dir() == tmp_path / "a"
    monkeypatch.setenv("STRATAGEM_CHECKPOINT_DIR", str(tmp_path / "s"))
    assert env.checkpoint_dir() == tmp_path / "s"  # Stratagem's own name first
    assert env.adaptdl_checkpoint_path() == str(tmp_path / "a")  # AdaptDL's first


def test_periodic_checkpoints_are_asynchronous_unless_turned_off(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.checkpoint_async()
    for value, expected in (("0", False), ("false", False), ("1", True), ("True", True)):
        monkeypatch.setenv("STRATAGEM_CHECKPOINT_ASYNC", value)
        assert env.checkpoint_async() is expected
    monkeypatch.setenv("STRATAGEM_CHECKPOINT_ASYNC", "later")
    with pytest.raises(StratagemError, match="STRATAGEM_CHECKPOINT_ASYNC='later'"):
        env.checkpoint_async()


def test_adaptdl_accessors_fall_back_to_torch_elastic(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "5")
    assert (env.adaptdl_num_replicas(), env.adaptdl_num_nodes(),
            env.adaptdl_replica_rank()) == (8, 2, 5)
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", "3")
    assert (env.adaptdl_num_replicas(), env.adaptdl_num_nodes()) == (3, 3)
    assert not env.adaptdl_rendezvous()
    monkeypatch.setenv("ADAPTDL_MASTER_PORT", "29500")
    assert env.adaptdl_rendezvous() and env.adaptdl_master_port() == 29500


def test_the_nodes_of_a_job_started_without_a_spec(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.job_nodes(4) == 1  # this machine alone
    assert env.job_node_rank(3, 4, 1) == 0
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")  # torchrun --nnodes 2 --nproc-per-node 8
    assert env.job_nodes(16) == 2
    assert env.job_node_rank(3, 16, 2) == 0 and env.job_node_rank(9, 16, 2) == 1
    monkeypatch.setenv("GROUP_RANK", "1")  # torch elastic says which node
    assert env.job_node_rank(3, 16, 2) == 1
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    monkeypatch.delenv("GROUP_RANK")
    monkeypatch.setenv("ADAPTDL_NUM_NODES", "3")  # alone: not an AdaptDL job
    assert env.job_nodes(6) == 1
    monkeypatch.setenv("ADAPTDL_NUM_REPLICAS", "5")  # AdaptDL: 5 replicas on 3 nodes
    assert env.job_nodes(5) == 3
    assert [env.job_node_rank(r, 5, 3) for r in range(5)] == [0, 0, 1, 1, 2]
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "x")
    with pytest.raises(StratagemError, match="LOCAL_WORLD_SIZE='x'"):
        env.job_nodes(2)


def test_rescale_and_hints_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    assert env.rescale_store() is None and not env.rescale_host()
    assert env.rescale_timeout() == timedelta(seconds=300)
    assert env.rescale_nproc() == 1
    monkeypatch.setenv("WORLD_SIZE", "3")
    assert env.rescale_nproc() == 3
    assert env.hints_port() is None and env.hints_addr() == "127.0.0.1"
    monkeypatch.setenv("STRATAGEM_HINTS_PORT", "0")
    assert env.hints_port() == 0


def test_every_name_has_a_documented_accessor() -> None:
    """Each variable's name appears in the docstring of a public accessor."""
    docs = " ".join(f.__doc__ or "" for name, f in vars(env).items()
                    if callable(f) and not name.startswith("_") and f.__module__ == env.__name__)
    assert [name for name in ALL if name not in docs] == []


def test_the_reference_page_lists_every_accessor() -> None:
    page = (Path(__file__).resolve().parents[1] / "docs" / "reference"
            / "environment.md").read_text()
    accessors = [name for name, f in vars(env).items() if callable(f)
                 and not name.startswith("_") and getattr(f, "__module__", "") == env.__name__]
    assert accessors and [a for a in accessors if f"`env.{a}()`" not in page] == []


@pytest.mark.parametrize(("name", "value", "valid"), [
    ("STRATAGEM_PG_TIMEOUT_S", "nan", "finite"), ("STRATAGEM_PG_TIMEOUT_S", "1e309", "finite"),
    ("STRATAGEM_PG_TIMEOUT_S", "0", "more than 0 and at most 604800"),
    ("STRATAGEM_PG_TIMEOUT_S", "-1", "more than 0 and at most 604800"),
    ("STRATAGEM_PG_TIMEOUT_S", "1e9", "more than 0 and at most 604800"),
    ("STRATAGEM_PS_TIMEOUT", "inf", "finite"),
    ("STRATAGEM_RESCALE_TIMEOUT_S", "-5", "more than 0"),
    ("STRATAGEM_PEER_TIMEOUT_S", "nan", "finite"),
    ("STRATAGEM_PEER_TIMEOUT_S", "-1", "0 (disabled) to 604800"),
    ("STRATAGEM_CHECKPOINT_SECONDS", "nan", "finite"),
    ("STRATAGEM_CHECKPOINT_SECONDS", "inf", "finite"),
    ("STRATAGEM_CHECKPOINT_DIR", "   ", "a directory"),
    ("ADAPTDL_CHECKPOINT_PATH", "\t", "a directory"),
])
def test_bad_numbers_and_blank_directories_name_the_variable_and_range(
        monkeypatch: pytest.MonkeyPatch, name: str, value: str, valid: str) -> None:
    for other in ALL:
        monkeypatch.delenv(other, raising=False)
    monkeypatch.setenv(name, value)
    with pytest.raises(StratagemError) as err, warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        env.validate()
    assert name in str(err.value) and valid in f"{err.value} {err.value.fix}"


def test_zero_peer_timeout_still_disables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("STRATAGEM_PEER_TIMEOUT_S", "0")
    assert env.peer_timeout() == 0
