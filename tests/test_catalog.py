"""The catalog: the issue's format loads; every documented mistake is one located error line."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from helpers import ISSUE_EXAMPLE, dgx, write_inputs
from typer.testing import CliRunner

from cluster_cli.cli.main import app
from cluster_cli.config.catalog import load_catalog
from cluster_cli.errors import ConfigError

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


def write(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "catalog.yaml"
    p.write_text(body)
    return p


def one_model(profiles: str, replicas: str = "1", name: str = "m", model: bool = True) -> str:
    """One model; each profile written as ``- {...}`` is given ``model: /m`` unless ``model`` is False."""
    if model:
        profiles = profiles.replace("- {name:", "- {model: /m, name:")
    return f"models:\n  - name: {name}\n    replicas: {replicas}\n    profiles:\n{profiles}"


def test_issue_example_loads(tmp_path: Path) -> None:
    cat = load_catalog(write(tmp_path, ISSUE_EXAMPLE))
    m = cat.model("llama-70b")
    assert m is not None and m.replicas == 2
    assert [p.name for p in m.ordered_profiles()] == ["h100-tp8", "a100-2x8", "cpu"]
    a100 = m.profile("a100-2x8")
    assert a100 is not None and a100.nodes == 2 and a100.gpus_per_node == 8
    cpu = m.profile("cpu")
    assert cpu is not None and cpu.is_cpu and cpu.gpus_per_node == 0 and cpu.memory_mib == 64 * 1024
    assert cat.command("llamacpp") == "llama-server"


def test_example_catalog_loads_and_has_tiny_cpu_model() -> None:
    cat = load_catalog(EXAMPLES / "catalog.yaml")
    tiny = cat.model("tiny")
    assert tiny is not None
    (p,) = tiny.profiles
    assert p.engine == "llamacpp" and p.is_cpu and (p.model or "").endswith(".gguf")
    assert any(not p.is_cpu for m in cat.models for p in m.profiles)


def test_a_catalog_without_engines_uses_the_built_in_ones(tmp_path: Path) -> None:
    cat = load_catalog(write(tmp_path, one_model("      - {name: a, engine: llamacpp, cpus: 1}\n")))
    assert cat.command("llamacpp") == "llama-server"


def test_defaults_and_tie_order(tmp_path: Path) -> None:
    body = one_model(
        "      - {name: a, engine: vllm, gpu_class: H100}\n"
        "      - {name: b, engine: vllm, gpu_class: A100, priority: 5}\n"
        "      - {name: c, engine: vllm, gpu_class: L40S, priority: 5}\n"
    )
    m = load_catalog(write(tmp_path, body)).models[0]
    assert [p.name for p in m.ordered_profiles()] == ["b", "c", "a"]  # equal priority: written order
    assert m.profiles[0].gpus_per_node == 1 and m.profiles[0].nodes == 1 and m.profiles[0].priority == 0


@pytest.mark.parametrize(
    ("body", "where", "needle"),
    [
        (one_model("      - {name: a, engine: vllm, gpus: 8}\n"), "models.0.profiles.0.gpu_class", "needs a gpu_class"),
        (one_model("      - {name: a, engine: llamacpp, nodes: 2}\n"), "models.0.profiles.0.nodes", "several nodes"),
        (
            one_model("      - {name: a, engine: llamacpp, gpu_class: L40S, gpus: 2}\n"),
            "models.0.profiles.0.gpus",
            "one GPU",
        ),
        (one_model("      - {name: a, engine: llamacpp, gpus: 1}\n"), "models.0.profiles.0", "gpu_class"),
        (
            one_model("      - {name: a, engine: tgi, gpu_class: H100}\n"),
            "models.0.profiles.0.engine",
            "unknown engine 'tgi'",
        ),
        ("engines: {tgi: {command: tgi}}\nmodels: []\n", "engines.tgi", "unknown engine"),
        (
            "engines: {vllm: {command: vllm}}\n" + one_model("      - {name: a, engine: llamacpp, cpus: 1}\n"),
            "models.0.profiles.0.engine",
            "'llamacpp' is not in this catalog's engines (vllm)",
        ),
        (
            "engines: {}\n" + one_model("      - {name: a, engine: vllm, gpu_class: H100}\n"),
            "models.0.profiles.0.engine",
            "'vllm' is not in this catalog's engines (none)",
        ),
        (
            one_model("      - {name: a, engine: vllm, gpu_class: H100}\n")
            + one_model("      - {name: b, engine: vllm, gpu_class: H100}\n")[7:],
            "models.1.name",
            "duplicate model name 'm'",
        ),
        (
            one_model(
                "      - {name: a, engine: vllm, gpu_class: H100}\n      - {name: a, engine: vllm, gpu_class: A100}\n"
            ),
            "models.0.profiles.1.name",
            "duplicate profile name 'a'",
        ),
        (
            one_model("      - {name: a, engine: vllm, gpu_class: H100, gpus: 0}\n"),
            "models.0.profiles.0.gpus",
            "greater than 0",
        ),
        (
            one_model("      - {name: a, engine: vllm, gpu_class: H100, nodes: 0}\n"),
            "models.0.profiles.0.nodes",
            "greater than 0",
        ),
        (one_model("      - {name: a, engine: llamacpp, cpus: -4}\n"), "models.0.profiles.0.cpus", "greater than 0"),
        (
            one_model("      - {name: a, engine: llamacpp, memory_gib: 0}\n"),
            "models.0.profiles.0.memory_gib",
            "greater than 0",
        ),
        (
            one_model("      - {name: a, engine: llamacpp, memory_gib: .inf}\n"),
            "models.0.profiles.0.memory_gib",
            "finite number",
        ),
        (
            one_model("      - {name: a, engine: llamacpp, memory_gib: 1.0e+400}\n"),
            "models.0.profiles.0.memory_gib",
            "finite number",
        ),
        (
            one_model("      - {name: a, engine: llamacpp, memory_gib: 0.0001}\n"),
            "models.0.profiles.0.memory_gib",
            "at least 1 MiB",
        ),
        (
            one_model("      - {name: a, engine: vllm, gpu_class: H100}\n", replicas="0"),
            "models.0.replicas",
            "greater than 0",
        ),
        (
            one_model("      - {name: a, engine: vllm, gpu_class: H100, gpu: 8}\n"),
            "models.0.profiles.0.gpu",
            "unknown key",
        ),
        (
            one_model("      - {name: a, engine: vllm, gpu_class: ''}\n"),
            "models.0.profiles.0.gpu_class",
            "must not be empty",
        ),
        (
            one_model("      - {name: a, engine: vllm, gpu_class: H100}\n", name="'bad name'"),
            "models.0.name",
            "invalid name",
        ),
        ("models:\n  - name: m\n    profiles: []\n", "models.0.profiles", "at least 1"),
        ("models: []\nmodels: []\n", "line 2", "duplicate key 'models'"),
    ],
)
def test_bad_catalog_is_one_located_line(tmp_path: Path, body: str, where: str, needle: str) -> None:
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as e:
        load_catalog(path)
    msg = str(e.value)
    assert "\n" not in msg
    # file, then the line (and the list item's name) where the YAML has them, then the field
    assert re.match(rf"{re.escape(str(path))}: (line [0-9]+( \([^)]*\))?: )?{re.escape(where)}", msg), msg
    assert needle in msg, msg


@pytest.mark.parametrize(
    ("profile", "needle"),
    [
        ("{name: a, engine: vllm, gpu_class: H100}",
         "line 5 (a): models.0.profiles.0.model: missing: the path or hub id vllm loads is required"),
        ("{name: a, engine: llamacpp, cpus: 4}",
         "line 5 (a): models.0.profiles.0.model: missing: the path or hub id llamacpp loads is required "
         "(e.g. /models/llama-70b.Q4_K_M.gguf)"),
        ("\n        name: a\n        engine: vllm\n        gpu_class: H100\n        model: ' '",
         "line 9 (a): models.0.profiles.0.model: empty: the path or hub id vllm loads is required"),
    ],
)  # fmt: skip
def test_a_profile_must_say_what_its_engine_loads(tmp_path: Path, profile: str, needle: str) -> None:
    path = write(tmp_path, one_model(f"      - {profile}\n", model=False))
    with pytest.raises(ConfigError) as e:
        load_catalog(path)
    assert str(e.value).startswith(f"{path}: {needle}"), str(e.value)


@pytest.mark.parametrize(("field", "value"), [("cpus", "8"), ("memory_gib", "64")])
def test_gpu_profile_with_cpus_or_memory_is_refused(tmp_path: Path, field: str, value: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "models:\n  - name: m\n    profiles:\n"
        f"      - {{name: p, engine: vllm, gpu_class: H100, gpus: 1, {field}: {value}, model: /m}}\n"
    )
    with pytest.raises(ConfigError) as e:
        load_catalog(path)
    msg = str(e.value)
    assert "\n" not in msg and f"models.0.profiles.0.{field}: only a CPU profile" in msg, msg
    inv, cat, facts = write_inputs(tmp_path, [dgx("h1")], catalog=path.read_text())
    r = CliRunner().invoke(
        app,
        [
            "--state",
            str(tmp_path / "state.db"),
            "place",
            "--dry-run",
            "-i",
            str(inv),
            "-c",
            str(cat),
            "--facts",
            str(facts),
        ],
    )
    assert r.exit_code == 2, r.output


def test_gpu_class_unknown_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("models:\n  - {name: m, profiles: [{name: p, engine: vllm, gpu_class: unknown, model: /m}]}\n")
    with pytest.raises(ConfigError, match=r"models\.0\.profiles\.0\.gpu_class: 'unknown' is reserved"):
        load_catalog(path)


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("{name: m, replicas: true, profiles: [{name: p, engine: vllm, gpu_class: H100, model: /m}]}", "replicas"),
        ("{name: m, replicas: '2', profiles: [{name: p, engine: vllm, gpu_class: H100, model: /m}]}", "replicas"),
        ("{name: m, profiles: [{name: p, engine: vllm, gpu_class: H100, gpus: true, model: /m}]}", "profiles.0.gpus"),
        ("{name: m, profiles: [{name: p, engine: vllm, gpu_class: H100, nodes: '1', model: /m}]}", "profiles.0.nodes"),
        ("{name: m, profiles: [{name: p, engine: vllm, gpu_class: H100, priority: '9', model: /m}]}", "profiles.0.priority"),
        ("{name: m, profiles: [{name: p, engine: llamacpp, cpus: '4', model: /m}]}", "profiles.0.cpus"),
        ("{name: m, profiles: [{name: p, engine: llamacpp, memory_gib: true, model: /m}]}", "profiles.0.memory_gib"),
    ],
)  # fmt: skip
def test_catalog_numbers_are_strict(tmp_path: Path, text: str, where: str) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"models:\n  - {text}\n")
    with pytest.raises(ConfigError, match=rf"models\.0\.{where}: "):
        load_catalog(path)


def test_catalog_float_memory_still_takes_an_int(tmp_path: Path) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(
        "models:\n  - {name: m, profiles: [{name: p, engine: llamacpp, cpus: 4, memory_gib: 8, model: /m}]}\n"
    )
    assert load_catalog(path).models[0].profiles[0].memory_mib == 8192


# ---- what reaches a node's start script: no control character, no secret on a command line


def _cpu(extra: str = "", name: str = "a", model: str = "/m") -> str:
    return one_model(f"      - {{name: {name}, engine: llamacpp, cpus: 1, model: {model}{extra}}}\n", model=False)


@pytest.mark.parametrize("char", ["\\n", "\\r", "\\e", "\\t", "\\x9b", "\\u2028", "\\0"])
@pytest.mark.parametrize(
    ("body", "where"),
    [
        (lambda c: _cpu(name=f'"a{c}"'), "models.0.profiles.0.name"),
        (lambda c: one_model("      - {name: a, engine: llamacpp, cpus: 1}\n", name=f'"m{c}"'), "models.0.name"),
        (lambda c: _cpu(model=f'"/m{c}.gguf"'), "models.0.profiles.0.model"),
        (lambda c: _cpu(f', args: [--ctx-size, "4096{c}"]'), "models.0.profiles.0.args.1"),
        (lambda c: _cpu(f', env: {{"HF_TOKEN{c}": x}}'), "models.0.profiles.0.env"),
        (lambda c: _cpu(f', env: {{HF_TOKEN: "hf_x{c}"}}'), "models.0.profiles.0.env.HF_TOKEN"),
        (lambda c: f'engines: {{llamacpp: {{command: "llama-server{c}"}}}}\n' + _cpu(), "engines.llamacpp.command"),
        (lambda c: f'engines: {{llamacpp: {{command: l, args: ["-v{c}"]}}}}\n' + _cpu(), "engines.llamacpp.args.0"),
    ],
)
def test_a_control_character_in_what_reaches_the_node_is_refused(tmp_path: Path, body, where: str, char: str) -> None:
    """A newline or ``\\r`` would end a line of the start script's answers early, ESC would
    act on the operator's terminal: refused when the catalog loads, on one located line that
    does not repeat the value (an env value is a secret)."""
    path = write(tmp_path, body(char))
    with pytest.raises(ConfigError) as e:
        load_catalog(path)
    msg = str(e.value)
    assert msg.isprintable(), msg
    assert re.match(rf"{re.escape(str(path))}: line [0-9]+( \([^)]*\))?: {re.escape(where)}: ", msg), msg
    assert "control character" in msg and "hf_x" not in msg, msg


def test_a_control_character_is_located_on_its_own_line(tmp_path: Path) -> None:
    body = "models:\n  - name: m\n    profiles:\n      - name: a\n        engine: llamacpp\n        model: /m\n"
    body += '        args:\n          - --ctx-size\n          - "4096\\r@@OK 1 1"\n'
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as e:
        load_catalog(path)
    assert str(e.value).startswith(
        f"{path}: line 9 (a): models.0.profiles.0.args.1: holds a control character (U+000D at character 5)"
    ), str(e.value)


@pytest.mark.parametrize(
    "args",
    [
        "[--api-key, sk-123]",
        "[--api-key=sk-123]",
        "[--hf-token, hf_abc]",
        "[--hf_token=hf_abc]",
        "[--token, t]",
        "[--PASSWORD, pw]",
        "[-m, x, HF_TOKEN=hf_abc]",
        "[--extra, 'api_key=sk-1']",
        "[--some-key=v]",
    ],
)
@pytest.mark.parametrize("where", ["profile", "engine"])
def test_args_that_look_like_secrets_are_refused_with_a_hint(tmp_path: Path, args: str, where: str) -> None:
    if where == "profile":
        body, field = _cpu(f", args: {args}"), "models.0.profiles.0.args."
    else:
        body, field = f"engines: {{llamacpp: {{command: l, args: {args}}}}}\n" + _cpu(), "engines.llamacpp.args."
    path = write(tmp_path, body)
    with pytest.raises(ConfigError) as e:
        load_catalog(path)
    msg = str(e.value)
    assert field in msg and "looks like a secret" in msg and "profile's env" in msg and "0600" in msg, msg
    for secret in ("sk-123", "hf_abc", "pw", "sk-1"):
        assert secret not in msg.lower().replace("--password", ""), msg


@pytest.mark.parametrize("args", ["[--api-key-file, /etc/key]", "[--ctx-size, '4096', --keyword, x]", "[-t, '8']"])
def test_args_that_only_resemble_secret_options_load(tmp_path: Path, args: str) -> None:
    p = load_catalog(write(tmp_path, _cpu(f", args: {args}"))).models[0].profiles[0]
    assert p.args


def test_a_secret_in_env_loads(tmp_path: Path) -> None:
    p = load_catalog(write(tmp_path, _cpu(', env: {HF_TOKEN: "hf_x y\'z"}'))).models[0].profiles[0]
    assert p.env == {"HF_TOKEN": "hf_x y'z"}
