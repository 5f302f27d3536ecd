"""ResourceSpec: AutoDist-style YAML parses into nodes and replicas; every bad spec is one
ResourceSpecError naming the file, the field and the fix."""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest

from stratagem.errors import ResourceSpecError
from stratagem.resource import ResourceSpec, SSHConfig, is_loopback_address

EXAMPLES = Path(__file__).resolve().parents[1] / "examples" / "specs"


def write(tmp_path: Path, text: str, name: str = "spec.yml") -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def load(tmp_path: Path, text: str) -> ResourceSpec:
    return ResourceSpec.from_file(write(tmp_path, text))


FULL = """\
    nodes:
      - address: 10.0.0.2
        gpus: [0, 1, 2, 3]
        cpus: [0, 1, 2, 3, 4, 5, 6, 7]
        ssh_config: conf
        network_bandwidth: 25
      - address: 10.0.0.1
        gpus: [0, 1]
        chief: true
        network_bandwidth: 100.5
      - address: 10.0.0.3
        cpus: [0, 1]
        ssh_config: conf
    ssh:
      conf:
        username: ubuntu
        port: 2222
        key_file: /home/ubuntu/.ssh/id_rsa
        python_venv: source /home/ubuntu/venv/bin/activate
        shared_envs:
          NCCL_SOCKET_IFNAME: eth0
          OMP_NUM_THREADS: 4
"""


# --------------------------------------------------------------------------- valid specs
def test_full_autodist_spec_parses_every_field(tmp_path: Path) -> None:
    spec = load(tmp_path, FULL)
    n2, n1, n3 = spec.nodes  # file order is kept
    assert (n2.address, n1.address, n3.address) == ("10.0.0.2", "10.0.0.1", "10.0.0.3")
    assert n2.gpus == (0, 1, 2, 3) and n2.cpus == tuple(range(8))
    assert n2.ssh_config == "conf" and n2.network_bandwidth == 25.0
    assert isinstance(n2.network_bandwidth, float)
    assert n1.chief and not n2.chief and not n3.chief
    assert n1.network_bandwidth == 100.5 and n1.ssh_config is None
    assert n3.gpus == () and n3.cpus == (0, 1) and n3.network_bandwidth == 1.0
    assert spec.chief is n1
    assert spec.source == str(tmp_path / "spec.yml")

    conf = spec.ssh["conf"]
    assert conf == SSHConfig(username="ubuntu", port=2222, key_file="/home/ubuntu/.ssh/id_rsa",
                             python_venv="source /home/ubuntu/venv/bin/activate",
                             shared_envs={"NCCL_SOCKET_IFNAME": "eth0", "OMP_NUM_THREADS": "4"})
    assert spec.ssh_for(n2) is conf
    assert spec.ssh_for(n1) == SSHConfig()  # no group: defaults (port 22, no user)
    assert SSHConfig().port == 22


def test_replicas_chief_first_then_file_order(tmp_path: Path) -> None:
    spec = load(tmp_path, FULL)
    assert spec.replicas == [
        "10.0.0.1:GPU:0", "10.0.0.1:GPU:1",
        "10.0.0.2:GPU:0", "10.0.0.2:GPU:1", "10.0.0.2:GPU:2", "10.0.0.2:GPU:3",
    ]
    # one worker per GPU by default; the CPU-only node of a GPU cluster runs none
    assert [n.workers for n in spec.nodes] == [4, 2, 0]
    assert spec.num_workers == 6 and spec.uses_gpus and not spec.is_local


@pytest.mark.parametrize(
    ("node", "devices"),
    [
        ("gpus: [0, 1, 2, 3]\n    workers: 2", ["10.0.0.1:GPU:0", "10.0.0.1:GPU:1"]),
        ("gpus: [2, 5]", ["10.0.0.1:GPU:2", "10.0.0.1:GPU:5"]),
        ("gpus: 3", ["10.0.0.1:GPU:3"]),  # a lone index is a one-GPU list
        ("cpus: [0, 1]\n    workers: 3",
         ["10.0.0.1:CPU:0", "10.0.0.1:CPU:1", "10.0.0.1:CPU:2"]),
        ("cpus: [0, 1, 2, 3]", ["10.0.0.1:CPU:0"]),  # CPU-only: one worker by default
    ],
)
def test_worker_devices(tmp_path: Path, node: str, devices: list[str]) -> None:
    spec = load(tmp_path, f"nodes:\n  - address: 10.0.0.1\n    {node}\n")
    assert spec.replicas == devices
    assert spec.num_workers == len(devices)


def test_cpu_only_cluster_defaults(tmp_path: Path) -> None:
    spec = load(tmp_path, """\
        nodes:
          - address: 192.168.1.10
            chief: true
          - address: 192.168.1.11
        """)
    for n in spec.nodes:
        assert (n.gpus, n.cpus, n.workers, n.network_bandwidth) == ((), (0,), 1, 1.0)
        assert n.ssh_config is None
    assert spec.replicas == ["192.168.1.10:CPU:0", "192.168.1.11:CPU:0"]
    assert not spec.uses_gpus and spec.ssh == {}


def test_single_node_without_chief_becomes_chief(tmp_path: Path) -> None:
    spec = load(tmp_path, "nodes:\n  - address: 10.0.0.1\n")
    assert spec.nodes[0].chief and spec.chief.address == "10.0.0.1" and spec.is_local


@pytest.mark.parametrize(
    ("server", "gpus"),
    [
        ("    cpus: [0, 1]", "[0, 1]"),        # GPU cluster: a CPU-only node defaults to 0
        ("    cpus: [0, 1]", "0"),             # ... also when a GPU is given as a lone index
        ("    gpus: [0]\n    workers: 0", "[0, 1]"),  # explicit server-only GPU node
    ],
)
def test_server_only_nodes(tmp_path: Path, server: str, gpus: str) -> None:
    spec = load(tmp_path, f"""\
nodes:
  - address: 10.0.0.1
    gpus: {gpus}
    chief: true
  - address: 10.0.0.9
{server}
""")
    assert spec.node("10.0.0.9").workers == 0
    assert all(r.startswith("10.0.0.1:GPU:") for r in spec.replicas)


def test_explicit_cpu_workers_on_server_node(tmp_path: Path) -> None:
    spec = load(tmp_path, """\
        nodes:
          - address: 10.0.0.1
            gpus: [0]
            chief: true
          - address: 10.0.0.2
            workers: 2
        """)
    assert spec.replicas == ["10.0.0.1:GPU:0", "10.0.0.2:CPU:0", "10.0.0.2:CPU:1"]


def test_to_dict_round_trips(tmp_path: Path) -> None:
    spec = load(tmp_path, FULL)
    again = ResourceSpec.from_dict(spec.to_dict(), source=spec.source)
    assert again == spec
    assert again.replicas == spec.replicas


def test_local_spec_cpu_workers() -> None:
    spec = ResourceSpec.local(num_workers=3)
    assert spec.is_local and spec.chief.address == "127.0.0.1"
    assert spec.num_workers == 3 and len(spec.replicas) == 3
    if not spec.uses_gpus:
        assert spec.replicas == [f"127.0.0.1:CPU:{i}" for i in range(3)]


def test_node_lookup_names_known_addresses(tmp_path: Path) -> None:
    spec = load(tmp_path, FULL)
    assert spec.node("10.0.0.3").cpus == (0, 1)
    with pytest.raises(ResourceSpecError, match=r"no node with address '10\.9\.9\.9'") as err:
        spec.node("10.9.9.9")
    assert "10.0.0.1" in str(err.value) and "fix:" in str(err.value)


@pytest.mark.parametrize(
    ("address", "loopback"),
    [("127.0.0.1", True), ("127.0.1.1", True), ("localhost", True), ("::1", True),
     ("10.0.0.1", False), ("node-a.example.com", False), ("fe80::1", False)],
)
def test_is_loopback_address(address: str, loopback: bool) -> None:
    assert is_loopback_address(address) is loopback


# -------------------------------------------------------------------------- example specs
def test_example_specs_exist() -> None:
    assert {p.name for p in EXAMPLES.glob("*.yml")} >= {"local.yml", "two-node.yml",
                                                        "gpu-cluster.yml"}


def test_example_local() -> None:
    spec = ResourceSpec.from_file(EXAMPLES / "local.yml")
    assert spec.is_local and spec.replicas == ["127.0.0.1:CPU:0", "127.0.0.1:CPU:1"]


def test_example_two_node() -> None:
    spec = ResourceSpec.from_file(EXAMPLES / "two-node.yml")
    assert spec.replicas == ["192.168.1.10:CPU:0", "192.168.1.10:CPU:1",
                             "192.168.1.11:CPU:0", "192.168.1.11:CPU:1"]
    lab = spec.ssh["lab"]
    assert lab.username == "ubuntu" and lab.port == 22 and lab.key_file
    assert lab.python_venv and lab.python_venv.startswith("source ")
    assert lab.shared_envs["GLOO_SOCKET_IFNAME"] == "eth0"
    assert all(spec.ssh_for(n) is lab for n in spec.nodes)


def test_example_gpu_cluster() -> None:
    spec = ResourceSpec.from_file(EXAMPLES / "gpu-cluster.yml")
    assert spec.uses_gpus and spec.num_workers == 8
    assert spec.replicas[:4] == [f"10.0.0.1:GPU:{i}" for i in range(4)]
    assert spec.replicas[4:] == [f"10.0.0.2:GPU:{i}" for i in range(4)]
    server = spec.node("10.0.0.3")
    assert server.workers == 0 and server.gpus == ()
    assert spec.node("10.0.0.1").network_bandwidth == 100.0


# ----------------------------------------------------------------------------- bad specs
TWO = "  - address: 10.0.0.1\n    chief: true\n  - address: 10.0.0.2\n"

BAD = {
    "duplicate-address": (
        "nodes:\n  - address: 10.0.0.1\n    chief: true\n  - address: 10.0.0.1\n",
        "nodes[1].address", "duplicate address '10.0.0.1' (also nodes[0])",
        "list each machine once"),
    "two-chiefs": (
        "nodes:\n  - address: 10.0.0.1\n    chief: true\n  - address: 10.0.0.2\n"
        "    chief: true\n",
        "nodes", "2 chiefs", "mark exactly one node 'chief: true'"),
    "no-chief": (
        "nodes:\n  - address: 10.0.0.1\n  - address: 10.0.0.2\n",
        "nodes", "no chief among several nodes", "chief: true"),
    "loopback-mixed": (
        "nodes:\n  - address: 127.0.0.1\n    chief: true\n  - address: 10.0.0.2\n",
        "nodes", "loopback address '127.0.0.1' mixed with remote nodes",
        "network address"),
    "localhost-mixed": (
        "nodes:\n  - address: 10.0.0.1\n    chief: true\n  - address: localhost\n",
        "nodes", "loopback address 'localhost'", "network address"),
    "unknown-node-key": (
        "nodes:\n  - address: 10.0.0.1\n    gpu: [0]\n",
        "nodes[0].gpu", "unknown field", "did you mean 'gpus'?"),
    "unknown-node-key-chef": (
        "nodes:\n  - address: 10.0.0.1\n    chef: true\n",
        "nodes[0].chef", "unknown field", "did you mean 'chief'?"),
    "unknown-top-key": (
        "node:\n  - address: 10.0.0.1\n",
        "node", "unknown field", "did you mean 'nodes'?"),
    "unknown-ssh-key": (
        "nodes:\n  - address: 10.0.0.1\nssh:\n  conf:\n    user: me\n",
        "ssh.conf.user", "unknown field", "did you mean 'username'?"),
    "unknown-key-no-close-match": (
        "nodes:\n  - address: 10.0.0.1\n    zzzz: 1\n",
        "nodes[0].zzzz", "unknown field", "allowed fields are address, gpus"),
    "gpus-string": (
        'nodes:\n  - address: 10.0.0.1\n    gpus: "x"\n',
        "nodes[0].gpus", "expected a list of device indices", "write gpus as"),
    "gpus-item-string": (
        'nodes:\n  - address: 10.0.0.1\n    gpus: [0, "1"]\n',
        "nodes[0].gpus[1]", "expected a non-negative integer, got str '1'", "write gpus[1]"),
    "gpus-negative": (
        "nodes:\n  - address: 10.0.0.1\n    gpus: [-1]\n",
        "nodes[0].gpus[0]", "negative device index -1", "start at 0"),
    "gpus-duplicate": (
        "nodes:\n  - address: 10.0.0.1\n    gpus: [0, 0]\n",
        "nodes[0].gpus", "duplicate device index", "list each device once"),
    "cpus-float": (
        "nodes:\n  - address: 10.0.0.1\n    cpus: [0.5]\n",
        "nodes[0].cpus[0]", "expected a non-negative integer", "write cpus[0]"),
    "chief-string": (
        'nodes:\n  - address: 10.0.0.1\n    chief: "yes"\n',
        "nodes[0].chief", "expected true or false, got str 'yes'", "write chief as true"),
    "chief-int": (
        "nodes:\n  - address: 10.0.0.1\n    chief: 1\n",
        "nodes[0].chief", "expected true or false, got int 1", "write chief as"),
    "port-string": (
        'nodes:\n  - address: 10.0.0.1\nssh:\n  conf:\n    port: "22"\n',
        "ssh.conf.port", "expected an integer port, got str '22'", "write port as"),
    "port-range": (
        "nodes:\n  - address: 10.0.0.1\nssh:\n  conf:\n    port: 70000\n",
        "ssh.conf.port", "port 70000 out of range", "1-65535"),
    "username-int": (
        "nodes:\n  - address: 10.0.0.1\nssh:\n  conf:\n    username: 7\n",
        "ssh.conf.username", "expected a string", "write username"),
    "shared-envs-list": (
        "nodes:\n  - address: 10.0.0.1\nssh:\n  conf:\n    shared_envs: [A]\n",
        "ssh.conf.shared_envs", "expected a mapping of NAME: value", "write shared_envs"),
    "ssh-group-not-mapping": (
        "nodes:\n  - address: 10.0.0.1\nssh:\n  conf: 3\n",
        "ssh.conf", "expected a mapping", "write conf as"),
    "bandwidth-negative": (
        "nodes:\n  - address: 10.0.0.1\n    network_bandwidth: -5\n",
        "nodes[0].network_bandwidth", "must be a positive number, got -5", "Gbit/s"),
    "bandwidth-zero": (
        "nodes:\n  - address: 10.0.0.1\n    network_bandwidth: 0\n",
        "nodes[0].network_bandwidth", "must be a positive number, got 0", "Gbit/s"),
    "bandwidth-nan": (
        "nodes:\n  - address: 10.0.0.1\n    network_bandwidth: .nan\n",
        "nodes[0].network_bandwidth", "must be a positive number, got nan", "Gbit/s"),
    "bandwidth-inf": (
        "nodes:\n  - address: 10.0.0.1\n    network_bandwidth: .inf\n",
        "nodes[0].network_bandwidth", "must be a positive number, got inf", "Gbit/s"),
    "bandwidth-string": (
        "nodes:\n  - address: 10.0.0.1\n    network_bandwidth: 10Gbps\n",
        "nodes[0].network_bandwidth", "expected a number of Gbit/s", "write network_bandwidth"),
    "bandwidth-bool": (
        "nodes:\n  - address: 10.0.0.1\n    network_bandwidth: true\n",
        "nodes[0].network_bandwidth", "got bool True", "write network_bandwidth"),
    "unknown-ssh-group": (
        "nodes:\n  - address: 10.0.0.1\n    ssh_config: lab\nssh:\n  conf: {}\n",
        "nodes[0].ssh_config", "no ssh group named 'lab'", "known: ['conf']"),
    "unknown-ssh-group-none-defined": (
        "nodes:\n  - address: 10.0.0.1\n    ssh_config: lab\n",
        "nodes[0].ssh_config", "no ssh group named 'lab'", "known: none"),
    "workers-more-than-gpus": (
        "nodes:\n  - address: 10.0.0.1\n    gpus: [0, 1]\n    workers: 3\n",
        "nodes[0].workers", "3 workers but 2 GPUs", "at most one worker per GPU"),
    "workers-negative": (
        "nodes:\n  - address: 10.0.0.1\n    workers: -1\n",
        "nodes[0].workers", "negative worker count -1", "use 0 for a server-only node"),
    "workers-string": (
        "nodes:\n  - address: 10.0.0.1\n    workers: two\n",
        "nodes[0].workers", "expected a non-negative integer", "write workers"),
    "no-workers": (
        "nodes:\n  - address: 10.0.0.1\n    workers: 0\n",
        "nodes", "no node runs a worker", "workers: 1"),
    "address-missing": (
        "nodes:\n  - gpus: [0]\n",
        "nodes[0].address", "missing", "IP address or host"),
    "address-int": (
        "nodes:\n  - address: 10\n",
        "nodes[0].address", "expected a host or IP string", "write address"),
    "node-not-mapping": (
        "nodes:\n  - 10.0.0.1\n",
        "nodes[0]", "expected a mapping with at least 'address'", "write nodes[0]"),
    "nodes-missing": (
        "ssh: {}\n", "nodes", "missing", "add a 'nodes:' list"),
    "nodes-empty": (
        "nodes: []\n", "nodes", "empty", "list at least one node"),
    "nodes-mapping": (
        "nodes:\n  address: 10.0.0.1\n", "nodes", "expected a list of nodes", "write nodes"),
    "top-level-list": (
        "- address: 10.0.0.1\n", "(top level)", "expected a mapping, got list", "nodes:"),
    "empty-file": (
        "", "(top level)", "the file is empty", "add a 'nodes:' list"),
    "comments-only": (
        "# nothing here\n", "(top level)", "the file is empty", "add a 'nodes:' list"),
}


@pytest.mark.parametrize(("text", "field", "problem", "fix"), BAD.values(), ids=BAD.keys())
def test_bad_spec_names_file_field_and_fix(
    tmp_path: Path, text: str, field: str, problem: str, fix: str
) -> None:
    path = write(tmp_path, text, name="bad.yml")
    with pytest.raises(ResourceSpecError) as err:
        ResourceSpec.from_file(path)
    msg = str(err.value)
    head, _, hint = msg.partition("\n  fix: ")
    assert head == f"{path}: {field}: {err.value.problem}", msg  # file, then field path
    assert problem in err.value.problem, msg
    assert fix in hint, msg
    assert msg.count("fix:") == 1 and "\n" not in hint, msg  # exactly one error, two lines
    assert err.value.where == f"{path}: {field}"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.yml"
    with pytest.raises(ResourceSpecError) as err:
        ResourceSpec.from_file(path)
    assert str(err.value).startswith(f"{path}: file not found")
    assert "fix:" in str(err.value)


def test_directory_is_not_a_spec(tmp_path: Path) -> None:
    with pytest.raises(ResourceSpecError, match="file not found"):
        ResourceSpec.from_file(tmp_path)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("nodes:\n  - address: 10.0.0.1\n   chief: true\n", 3),
        ("nodes:\n\t- address: 10.0.0.1\n", 2),
        ("nodes:\n  - address: 10.0.0.1\n    gpus: [0, 1\n  - address: b\n", 4),
    ],
    ids=["bad-indent", "tab", "unclosed-list"],
)
def test_malformed_yaml_gives_line(tmp_path: Path, text: str, line: int) -> None:
    path = write(tmp_path, text, name="bad.yml")
    with pytest.raises(ResourceSpecError) as err:
        ResourceSpec.from_file(path)
    msg = str(err.value)
    assert msg.startswith(f"{path}: malformed YAML (line {line}, column "), msg
    assert msg.count("fix:") == 1 and "Traceback" not in msg
    assert err.value.__cause__ is None and err.value.__suppress_context__


def test_from_yaml_and_from_dict_name_their_source() -> None:
    with pytest.raises(ResourceSpecError, match=r"^<resource spec>: nodes: empty"):
        ResourceSpec.from_dict({"nodes": []})
    with pytest.raises(ResourceSpecError, match=r"^inline: nodes\[0\]\.gpus"):
        ResourceSpec.from_yaml("nodes:\n  - address: a\n    gpus: x\n", source="inline")


# ------------------------------------------------------------------------ reference docs
DOC = Path(__file__).resolve().parents[1] / "docs" / "reference" / "resource-spec.md"


def doc_blocks(lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", DOC.read_text(), re.S | re.M)


@pytest.mark.parametrize("index", range(4))
def test_yaml_blocks_in_reference_are_valid_specs(index: int) -> None:
    blocks = doc_blocks("yaml")
    assert len(blocks) == 4
    spec = ResourceSpec.from_yaml(blocks[index], source=f"{DOC.name} block {index}")
    assert spec.num_workers >= 1


def test_reference_examples_say_what_the_parser_does() -> None:
    full, local, two_node, partial = (
        ResourceSpec.from_yaml(b) for b in doc_blocks("yaml"))
    assert full.replicas == [f"10.0.0.{n}:GPU:{i}" for n in (1, 2) for i in range(4)]
    assert full.node("10.0.0.3").workers == 0
    assert local.replicas == ResourceSpec.from_file(EXAMPLES / "local.yml").replicas
    example = ResourceSpec.from_file(EXAMPLES / "two-node.yml")
    assert two_node.nodes == example.nodes and two_node.ssh == example.ssh
    assert partial.replicas == ["gpu-a.internal:GPU:0", "gpu-a.internal:GPU:1"]
    assert partial.node("gpu-b.internal").workers == 0


def test_reference_error_example_is_real() -> None:
    (text,) = [b for b in doc_blocks("text") if "fix:" in b]
    with pytest.raises(ResourceSpecError) as err:
        ResourceSpec.from_yaml("nodes:\n  - address: a\n    chief: true\n  - address: b\n"
                               "    gpu: [0]\n", source="cluster.yml")
    assert str(err.value) == text.strip()


# ------------------------------------------------------------- hostile or sloppy input
@pytest.mark.parametrize("address", ["-V", "-oProxyCommand=touch /tmp/x", "a b", "x;id",
                                     "$(id)", "", "010.0.0.1", "10.0.0.256", "host/..",
                                     "-host.example.com", "a..b"])
def test_address_must_be_a_host_name_or_ip(address: str) -> None:
    with pytest.raises(ResourceSpecError) as err:
        ResourceSpec.from_dict({"nodes": [{"address": address}]})
    assert err.value.where == "<resource spec>: nodes[0].address"
    assert "IP address" in (err.value.fix or "")


@pytest.mark.parametrize(("raw", "canonical"), [
    (" 10.0.0.1", "10.0.0.1"), ("10.0.0.1 ", "10.0.0.1"), ("0:0::1", "::1"),
    ("::ffff:10.0.0.1", "10.0.0.1"),
    ("node-1.example.com", "node-1.example.com"), ("worker_2", "worker_2")])
def test_addresses_are_normalized(raw: str, canonical: str) -> None:
    spec = ResourceSpec.from_dict({"nodes": [{"address": raw}]})
    assert spec.nodes[0].address == canonical


@pytest.mark.parametrize(("first", "second"), [
    ("10.0.0.1", " 10.0.0.1"), ("fe80::1", "FE80:0::1"), ("Node1.lan", "node1.lan"),
    ("10.0.0.1", "::ffff:10.0.0.1"), ("::FFFF:a00:1", "10.0.0.1")])
def test_one_machine_written_two_ways_is_a_duplicate(first: str, second: str) -> None:
    with pytest.raises(ResourceSpecError, match=r"duplicate address .* \(also nodes\[0\]\)"):
        ResourceSpec.from_dict({"nodes": [{"address": first, "chief": True},
                                          {"address": second}]})


def test_username_cannot_be_an_ssh_option() -> None:
    with pytest.raises(ResourceSpecError, match="invalid user name '-oProxyCommand=x'"):
        ResourceSpec.from_dict({"nodes": [{"address": "10.0.0.1"}],
                                "ssh": {"g": {"username": "-oProxyCommand=x"}}})


@pytest.mark.parametrize(("field", "value", "problem"), [
    ("workers", 10**23, "workers on one node"),
    ("cpus", [2**40], "device index 1099511627776 out of range"),
    ("network_bandwidth", 1e30, "must be a positive number"),
])
def test_values_are_bounded(field: str, value: object, problem: str) -> None:
    with pytest.raises(ResourceSpecError, match=problem) as err:
        ResourceSpec.from_dict({"nodes": [{"address": "10.0.0.1", field: value}]})
    assert err.value.fix


def test_yaml_alias_bomb_is_refused_quickly() -> None:
    lines = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    lines += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    bomb = "\n".join(["nodes:", "  - address: 10.0.0.1", "    ssh_config: g", "ssh:",
                      "  g:", "    shared_envs:"] + ["      " + line for line in lines])
    with pytest.raises(ResourceSpecError, match="alias \\*a0 is not allowed") as err:
        ResourceSpec.from_yaml(bomb)
    assert "aliases" in (err.value.fix or "")


@pytest.mark.parametrize("text", [
    "nodes:\n  - address: 10.0.0.1\n    workers: 1\n    workers: 4\n",
    "nodes:\n  - address: 10.0.0.1\nnodes:\n  - address: 10.0.0.2\n",
    "nodes: [{address: 10.0.0.1, chief: true, chief: false}]\n"])
def test_a_key_written_twice_is_refused(text: str) -> None:
    """YAML keeps the last of two equal keys silently: a spec that says ``workers`` twice
    would run with whichever came last."""
    with pytest.raises(ResourceSpecError, match="duplicate key") as err:
        ResourceSpec.from_yaml(text, source="cluster.yml")
    assert "once" in (err.value.fix or "") and "line" in str(err.value)


def test_shared_env_values_are_single_values() -> None:
    with pytest.raises(ResourceSpecError, match="expected a single value, got list"):
        ResourceSpec.from_dict({"nodes": [{"address": "10.0.0.1", "ssh_config": "g"}],
                                "ssh": {"g": {"shared_envs": {"A": [1, 2]}}}})
    with pytest.raises(ResourceSpecError, match="not an environment variable name"):
        ResourceSpec.from_dict({"nodes": [{"address": "10.0.0.1"}],
                                "ssh": {"g": {"shared_envs": {"A=B": "1"}}}})


@pytest.mark.parametrize("text", ["[" * 100_000, "nodes:\n" + "  " * 1 + "- " * 50_000 + "x",
                                  "x: " + "9" * 5000])
def test_deep_or_huge_values_are_a_spec_error(text: str) -> None:
    with pytest.raises(ResourceSpecError) as err:
        ResourceSpec.from_yaml(text)
    assert err.value.fix


def test_binary_file_is_a_spec_error(tmp_path: Path) -> None:
    path = tmp_path / "spec.yml"
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ResourceSpecError, match="cannot read the file"):
        ResourceSpec.from_file(path)


def test_local_workers_override_keeps_gpus_only_when_enough() -> None:
    spec = ResourceSpec.from_dict({"nodes": [{"address": "127.0.0.1", "gpus": [2, 3]}]})
    assert spec.with_local_workers(2).nodes[0].gpus == (2, 3)
    three = spec.with_local_workers(3)
    assert three.nodes[0].gpus == () and three.num_workers == 3
    with pytest.raises(ResourceSpecError, match="1025 worker processes on one node"):
        spec.with_local_workers(1025)


def test_gpu_for_maps_local_ranks_to_the_spec_gpus() -> None:
    spec = ResourceSpec.from_dict({"nodes": [
        {"address": "10.0.0.1", "gpus": [2, 3], "chief": True},
        {"address": "10.0.0.2", "gpus": [0, 5], "workers": 1}]})
    assert [spec.gpu_for("10.0.0.1", r) for r in (0, 1, 2)] == [2, 3, None]
    assert [spec.gpu_for("10.0.0.2", r) for r in (0, 1)] == [0, None]
    assert spec.gpu_for(None, 0) is None  # several nodes: which one is unknown
    assert spec.gpu_for("-bad-", 0) is None and spec.gpu_for(" 10.0.0.2", 0) == 0
    local = ResourceSpec.from_dict({"nodes": [{"address": "127.0.0.1", "gpus": [1]}]})
    assert local.gpu_for(None, 0) == 1


def test_a_job_without_a_spec_spans_nodes_like_this_one(monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """torchrun over several nodes with no resource spec: each node runs its share of the
    workers, on its GPUs where it has one per worker (not "this machine with every worker
    of the job", which has too few GPUs and trains on the CPU)."""
    import torch

    assert ResourceSpec.of_job(3, 1) == ResourceSpec.local(3)
    cpu = ResourceSpec.of_job(5, 3)  # 2 + 2 + 1 CPU workers
    assert [(n.address, n.workers, n.chief) for n in cpu.nodes] == [
        ("node0", 2, True), ("node1", 2, False), ("node2", 1, False)]
    assert cpu.replicas[:3] == ["node0:CPU:0", "node0:CPU:1", "node1:CPU:0"]
    assert not cpu.uses_gpus and cpu.source.startswith(ResourceSpec.JOB_SOURCE)
    assert cpu.of_this_job and not ResourceSpec.local(3).of_this_job
    # a spec file's source that spells the same words is still a spec file's
    spoof = ResourceSpec.from_dict({"nodes": [{"address": "10.0.0.1", "chief": True},
                                              {"address": "10.0.0.2"}]},
                                   source=f"{ResourceSpec.JOB_SOURCE}: 2 nodes like this one>")
    assert not spoof.of_this_job
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert not ResourceSpec.local(16).uses_gpus  # one machine, 16 workers, 8 GPUs
    gpus = ResourceSpec.of_job(16, 2)
    assert gpus.uses_gpus and gpus.num_workers == 16
    assert gpus.replicas[7:9] == ["node0:GPU:7", "node1:GPU:0"]
    assert not ResourceSpec.of_job(18, 2).uses_gpus  # 9 workers a node, 8 GPUs: the CPU
