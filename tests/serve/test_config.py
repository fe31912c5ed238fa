"""Configuration: precedence of the four layers, types, errors naming their source, docs."""

from __future__ import annotations

import dataclasses
import re
import sys
import tomllib
import typing
from ipaddress import ip_network
from pathlib import Path
from typing import Any, ClassVar

import pytest

from luced.serve.config import (
    GROUP_TYPES,
    Config,
    MoEOptions,
    Options,
    build_parser,
    check_group,
    load_config,
)
from luced.serve.config_docs import example_toml, options_markdown
from luced.serve.options import (
    CONTEXT_CAP,
    GROUPS,
    OPTIONS,
    ConfigError,
    ModelEntry,
    default_runtime_dir,
)

ROOT = Path(__file__).resolve().parents[2]


def load(
    argv: list[str] | None = None,
    env: dict[str, str] | None = None,
    toml: str | None = None,
    tmp_path: Path | None = None,
) -> Config:
    """load_config with an isolated environment and, if given, a config file."""
    argv = list(argv or [])
    if toml is not None:
        assert tmp_path is not None
        path = tmp_path / "luced.toml"
        path.write_text(toml)
        argv = ["--config", str(path), *argv]
    return load_config(argv, env=dict(env or {}), default_config_path=None)


# One sample per option: (flag/env text, TOML text, expected typed value), all different
# from the defaults. A new option without a sample fails test_every_option_* below.
SAMPLES: dict[str, tuple[str, str, Any]] = {
    "model": ("/m/x.gguf", '"/m/x.gguf"', Path("/m/x.gguf")),
    "host": ("0.0.0.0", '"0.0.0.0"', "0.0.0.0"),
    "port": ("9001", "9001", 9001),
    "api_key": ("sk-test", '"sk-test"', "sk-test"),
    "api_key_file": ("/k/key", '"/k/key"', Path("/k/key")),
    "metrics_public": ("true", "true", True),
    "kv_dtype": ("bfloat16", "\"bfloat16\"", "bfloat16"),
    "batch_invariant": ("true", "true", True),
    "decode_graphs": ("off", '"off"', "off"),
    "decode_ahead": ("on", '"on"', "on"),
    "allowed_hosts": ("a.example,b", '["a.example", "b"]', ("a.example", "b")),
    "allowed_origins": ("http://x:1", '["http://x:1"]', ("http://x:1",)),
    "model_name": ("smol", '"smol"', "smol"),
    "models": ("a=/m/a.gguf", '{ a = "/m/a.gguf" }', (ModelEntry("a", Path("/m/a.gguf")),)),
    "models_dir": ("/m", '"/m"', Path("/m")),
    "preload": ("a,b", '["a", "b"]', ("a", "b")),
    "model_keep_alive": ("60", "60", 60.0),
    "models_memory_budget": ("8G", '"8G"', 8 * 2**30),
    "model_load_timeout": ("90", "90.0", 90.0),
    "dtype": ("bfloat16", '"bfloat16"', "bfloat16"),
    "weights": ("int4", '"int4"', "int4"),
    "kernels": ("torch", '"torch"', "torch"),
    "threads": ("3", "3", 3),
    "context_length": ("4096", "4096", 4096),
    "pooling": ("last", '"last"', "last"),
    "max_queue": ("0", "0", 0),
    "max_running": ("3", "3", 3),
    "kv_pool_tokens": ("8192", "8192", 8192),
    "kv_block_size": ("32", "32", 32),
    "kv_keep_tokens": ("0", "0", 0),
    "max_queued_tokens": ("1000", "1000", 1000),
    "max_batch_tokens": ("64", "64", 64),
    "max_step_tokens": ("700", "700", 700),
    "default_max_tokens": ("256", "256", 256),
    "shutdown_timeout": ("2.5", "2.5", 2.5),
    "worker_timeout": ("4.5", "4.5", 4.5),
    "worker_start_timeout": ("120", "120.0", 120.0),
    "worker_key_file": ("/k/worker.key", '"/k/worker.key"', Path("/k/worker.key")),
    "http_timeout": ("7.5", "7.5", 7.5),
    "max_connections": ("64", "64", 64),
    "trusted_proxies": (
        "10.0.0.0/8, fd00::1", '["10.0.0.0/8", "fd00::1"]',
        (ip_network("10.0.0.0/8"), ip_network("fd00::1")),
    ),
    "runtime_dir": ("/srv/rt", '"/srv/rt"', Path("/srv/rt")),
    "admin_socket": ("/srv/a.sock", '"/srv/a.sock"', Path("/srv/a.sock")),
    "backend_python": ("hip=/r/py", '{ hip = "/r/py" }', (("hip", Path("/r/py")),)),
    "target_devices": ("cpu:1", '["cpu:1"]', ("cpu:1",)),
    "target_layer_split": ("3", "[3]", (3.0,)),
    "draft": ("/m/d.gguf", '"/m/d.gguf"', Path("/m/d.gguf")),
    "draft_device": ("cpu:1", '"cpu:1"', "cpu:1"),
    "block_size": ("4", "4", 4),
    "adaptive_block_size": ("false", "false", False),
    "prefix_cache_bytes": ("512M", '"512M"', 512 * 2**20),
    "kv_cache_dir": ("/srv/kv", '"/srv/kv"', Path("/srv/kv")),
    "kv_cache_budget": ("1.5G", "1610612736", 1610612736),
    "kv_flash": ("2048", "2048", 2048),
    "kv_flash_policy": ("lru", '"lru"', "lru"),
    "kv_flash_tau": ("128", "128", 128),
    "kv_flash_max_pool": ("4096", "4096", 4096),
    "moe_hot_experts": ("4", "4", 4),
    "moe_routing_profile": ("/m/p.json", '"/m/p.json"', Path("/m/p.json")),
    "moe_expert_device": ("cpu:1", '"cpu:1"', "cpu:1"),
    "moe_expert_required": ("true", "true", True),
    "log_level": ("debug", '"debug"', "debug"),
}  # fmt: skip


def test_kv_flash_takes_tokens_or_auto() -> None:
    assert load(["--kv-flash", "auto"]).kv.kv_flash == "auto"
    assert load(env={"LUCED_KV_FLASH": "AUTO"}).kv.kv_flash == "auto"
    assert load().kv.kv_flash is None  # off by default
    with pytest.raises(ConfigError, match="--kv-flash"):
        load(["--kv-flash", "0"])
    with pytest.raises(ConfigError, match="not an integer"):
        load(["--kv-flash", "lots"])


def test_every_option_has_a_sample() -> None:
    assert sorted(SAMPLES) == sorted(o.name for o in OPTIONS)


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: o.name)
def test_every_option_reaches_config_by_each_route(opt: Any, tmp_path: Path) -> None:
    text, toml_text, expected = SAMPLES[opt.name]
    default = load(env={}).value(opt.name)
    assert default != expected, "the sample must differ from the default"
    by_flag = load([text] if opt.positional else [opt.flag, text])
    by_env = load(env={opt.env: text})
    by_file = load(toml=f"{opt.name} = {toml_text}\n", tmp_path=tmp_path)
    for config, source in ((by_flag, opt.flag), (by_env, opt.env)):
        assert config.value(opt.name) == expected
        assert getattr(config, opt.group).sources[opt.name] == source
        assert config.label(opt.name) == source
    assert by_file.value(opt.name) == expected
    assert by_file.sources[opt.name] == f"{tmp_path / 'luced.toml'}: {opt.name}"


@pytest.mark.parametrize(
    ("name", "flag", "env", "file", "default"),
    [
        ("port", "1111", "2222", "3333", 8000),
        ("log_level", "debug", "warning", '"error"', "info"),
        ("shutdown_timeout", "1.5", "2", "3", 30.0),
        ("max_queue", "1", "2", "3", 16),
        ("host", "::1", "10.0.0.1", '"192.168.0.1"', "127.0.0.1"),
    ],
)
def test_precedence_flags_env_file_defaults(
    name: str, flag: str, env: str, file: str, default: Any, tmp_path: Path
) -> None:
    opt = next(o for o in OPTIONS if o.name == name)
    toml = f"{name} = {file}\n"
    conv = type(default)
    flag_v, env_v, file_v = conv(flag), conv(env), conv(tomllib.loads(toml)[name])
    assert len({flag_v, env_v, file_v, default}) == 4

    def value(argv: list[str], environ: dict[str, str], with_file: bool) -> Any:
        config = load(argv, environ, toml if with_file else None, tmp_path)
        return config.value(name)

    f, e = [opt.flag, flag], {opt.env: env}
    assert value(f, e, True) == flag_v
    assert value([], e, True) == env_v
    assert value([], {}, True) == file_v
    assert value([], {}, False) == default
    assert value(f, {}, True) == flag_v
    assert value(f, e, False) == flag_v
    # typed, not text: "2" from the environment is a float for a float option, etc.
    assert type(value([], e, True)) is conv


def test_layers_combine_per_option(tmp_path: Path) -> None:
    config = load(
        ["--port", "1", "/m/a.gguf"],
        {"LUCED_PORT": "2", "LUCED_DTYPE": "bfloat16", "LUCED_MODEL": "/m/env.gguf"},
        'port = 3\ndtype = "float16"\nmax_queue = 5\nmodel = "/m/file.gguf"\n',
        tmp_path,
    )
    assert (config.http.port, config.model.dtype, config.scheduler.max_queue) == (1, "bfloat16", 5)
    assert config.model.model == Path("/m/a.gguf")
    assert config.sources["port"] == "--port"
    assert config.sources["model"] == "MODEL"
    assert config.sources["dtype"] == "LUCED_DTYPE"
    assert config.sources["max_queue"].endswith("luced.toml: max_queue")
    assert config.sources["host"] == "default"


def test_repeatable_backend_python(tmp_path: Path) -> None:
    config = load(["--backend-python", "cuda=/a/py", "--backend-python", "hip=/b/py"])
    model = config.model
    assert model.backend_python == (("cuda", Path("/a/py")), ("hip", Path("/b/py")))
    assert model.worker_python("hip") == "/b/py"
    assert model.worker_python("cpu") == sys.executable
    env = load(env={"LUCED_BACKEND_PYTHON": "cuda=/a/py, hip=/b/py"})
    assert env.model.backend_python == model.backend_python
    listed = load(toml='backend_python = ["cuda=/a/py", "hip=/b/py"]\n', tmp_path=tmp_path)
    assert listed.model.backend_python == model.backend_python
    # a higher layer replaces the list as a whole
    both = load(["--backend-python", "cpu=/c/py"], {"LUCED_BACKEND_PYTHON": "cuda=/a/py"})
    assert both.model.backend_python == (("cpu", Path("/c/py")),)


def test_served_models_by_flag_env_and_file(tmp_path: Path) -> None:
    by_flag = load(["--model", "a=/m/a.gguf", "--model", "/m/qwen3:8b.gguf"])
    assert by_flag.registry.models == (
        ModelEntry("a", Path("/m/a.gguf")),
        ModelEntry("qwen3:8b", Path("/m/qwen3:8b.gguf")),  # a bare path: named by its stem
    )
    assert by_flag.registry.several and by_flag.model.model is None
    by_env = load(env={"LUCED_MODELS": "a=/m/a.gguf, qwen3:8b=/m/qwen3:8b.gguf"})
    assert by_env.registry.models == by_flag.registry.models
    toml = '[models.a]\nmodel = "/m/a.gguf"\nmax_running = 2\n[models.b]\nkv_flash = "auto"\n'
    by_file = load(toml=toml, tmp_path=tmp_path)
    assert by_file.registry.models == (
        ModelEntry("a", Path("/m/a.gguf"), (("max_running", 2),)),
        ModelEntry("b", None, (("kv_flash", "auto"),)),  # its file: models_dir's b.gguf
    )
    # flags replace the file's table as a whole, settings included
    both = load(["--model", "c=/m/c.gguf"], toml=toml, tmp_path=tmp_path)
    assert both.registry.models == (ModelEntry("c", Path("/m/c.gguf")),)


@pytest.mark.parametrize(
    ("argv", "env", "toml", "message"),
    [
        ([], {"LUCED_PORT": "x"}, None, "LUCED_PORT: not an integer: 'x'"),
        (["--port", "x"], {}, None, "--port: not an integer: 'x'"),
        ([], {}, 'port = "x"', "{file}: port: not an integer: 'x'"),
        ([], {}, "port = 80.5", "{file}: port: not an integer: 80.5"),
        ([], {}, "port = true", "{file}: port: not an integer: True"),
        (["--port", "70000"], {}, None, "--port: must be <= 65535, got 70000"),
        ([], {"LUCED_THREADS": "0"}, None, "LUCED_THREADS: must be >= 1, got 0"),
        ([], {"LUCED_DTYPE": "f8"}, None, "LUCED_DTYPE: not one of float32, bfloat16, float16"),
        ([], {}, "shutdown_timeout = -1", "{file}: shutdown_timeout: must be >= 0, got -1.0"),
        (["--shutdown-timeout", "nan"], {}, None, "--shutdown-timeout: not a finite number: 'nan'"),
        ([], {}, "host = 1", "{file}: host: not a string: 1"),
        ([], {}, 'model = ""', "{file}: model: empty string"),
        (["--backend-python", "cuda"], {}, None, "--backend-python: not GROUP=PATH: 'cuda'"),
        ([], {"LUCED_BACKEND_PYTHON": "a=/x,a=/y"}, None, "LUCED_BACKEND_PYTHON: group 'a' given"),
        (
            ["--trusted-proxies", "10.0.0.1/8"], {}, None,
            "--trusted-proxies: not an address or network: '10.0.0.1/8' (10.0.0.1/8 has host",
        ),
        ([], {}, "trusted_proxies = [1]", "{file}: trusted_proxies: not an address or network: 1"),
        ([], {}, "prot = 1", "{file}: unknown option 'prot' (did you mean 'port'?)"),
        ([], {}, "max-queue = 1", "{file}: unknown option 'max-queue' (did you mean 'max_queue'?)"),
        ([], {}, "port = ", "{file}: invalid TOML: "),
        # the groups are not tables of the file: every key is top level
        ([], {}, "[http]\nport = 1", "{file}: unknown option 'http'"),
        (
            ["--context-length", "100"], {"LUCED_DEFAULT_MAX_TOKENS": "200"}, None,
            "LUCED_DEFAULT_MAX_TOKENS: 200 exceeds context_length 100",
        ),
    ],
)  # fmt: skip
def test_errors_name_the_option_and_its_source(
    argv: list[str], env: dict[str, str], toml: str | None, message: str, tmp_path: Path
) -> None:
    expected = message.format(file=tmp_path / "luced.toml")
    with pytest.raises(ConfigError) as exc:
        load(argv, env, toml, tmp_path)
    assert str(exc.value).startswith(expected)


def test_config_file_discovery(tmp_path: Path) -> None:
    default = tmp_path / "etc.toml"
    default.write_text("port = 1\n")
    other = tmp_path / "other.toml"
    other.write_text("port = 2\n")
    assert load_config([], env={}, default_config_path=default).http.port == 1
    absent = tmp_path / "absent.toml"
    assert load_config([], env={}, default_config_path=absent).http.port == 8000
    env = {"LUCED_CONFIG": str(other)}
    assert load_config([], env=env, default_config_path=default).http.port == 2
    assert load_config(["--config", str(default)], env=env).http.port == 1
    with pytest.raises(ConfigError, match=f"config file not found: {absent}"):
        load_config(["--config", str(absent)], env={})


def test_defaults_and_derived_values(tmp_path: Path) -> None:
    config = load(env={"XDG_RUNTIME_DIR": str(tmp_path)})
    assert config.model.model is None and config.model.model_name is None
    assert config.http.api_key is None
    assert config.http.port == 8000 and config.http.host == "127.0.0.1"
    assert config.model.threads is None  # the daemon shares the usable cores among its workers
    assert config.daemon.runtime_dir == tmp_path / "luced"
    assert config.daemon.admin_socket == tmp_path / "luced" / "admin.sock"
    moved = load(["--runtime-dir", "/srv/rt"])
    assert moved.daemon.admin_socket == Path("/srv/rt/admin.sock")
    named = load(["--runtime-dir", "/srv/rt", "--admin-socket", "/x.sock"])
    assert named.daemon.admin_socket == Path("/x.sock")


def test_default_runtime_dir() -> None:
    assert default_runtime_dir({"RUNTIME_DIRECTORY": "/run/luced:/run/other"}) == Path("/run/luced")
    assert default_runtime_dir({"XDG_RUNTIME_DIR": "/run/user/7"}) == Path("/run/user/7/luced")
    assert re.fullmatch(r"/tmp/luced-\d+", str(default_runtime_dir({})))


def test_lazy_model_resolution(smollm2_gguf: Path) -> None:
    model = load().model
    assert model.model is None  # nothing resolved at load time
    assert model.model_path() == smollm2_gguf
    assert model.served_model_name() == "SmolLM2-135M-Instruct.Q4_1"
    named = load(["/models/qwen3-0.6b.gguf"]).model
    assert named.served_model_name() == "qwen3-0.6b"
    assert load(["/m/x.gguf", "--model-name", "x"]).model.served_model_name() == "x"


def test_bundled_models_by_name(
    gemma3_gguf: Path, smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`luced serve gemma3-270m` serves the bundled Gemma 3; a path still works; an unknown
    bare name is an error that lists the bundled names."""
    gemma = load(["gemma3-270m"]).model
    assert gemma.model_path() == gemma3_gguf
    assert gemma.served_model_name() == gemma3_gguf.stem
    assert load(["smollm2-135m"]).model.model_path() == smollm2_gguf
    assert load(env={"LUCED_MODEL": "gemma3-270m"}).model.model_path() == gemma3_gguf
    monkeypatch.chdir(tmp_path)
    Path("gemma3-270m").write_bytes(b"GGUF")  # a file of that name is served as the file
    assert load(["gemma3-270m"]).model.model_path() == Path("gemma3-270m")
    with pytest.raises(ConfigError) as info:
        load(["gemma3"]).model.model_path()
    assert str(info.value) == (
        "MODEL: 'gemma3' is neither a file nor a bundled model; the bundled models are "
        "smollm2-135m, gemma3-270m (or give the path of a .gguf file)"
    )
    with pytest.raises(ConfigError, match=r"^LUCED_MODEL: 'qwen' is neither"):
        load(env={"LUCED_MODEL": "qwen"}).model.served_model_name()


def test_effective_context_length() -> None:
    assert load().model.effective_context_length(2048) == 2048
    assert load().model.effective_context_length(131072) == CONTEXT_CAP
    assert load(["--context-length", "1000"]).model.effective_context_length(2048) == 1000
    with pytest.raises(ConfigError, match="LUCED_CONTEXT_LENGTH: 4096 exceeds the model's"):
        load(env={"LUCED_CONTEXT_LENGTH": "4096"}).model.effective_context_length(2048)


def test_config_is_frozen_and_validated_on_construction() -> None:
    config = Config.from_values({"port": "9000"}, env={})
    assert config.http.port == 9000
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.http.port = 1  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.http = config.http  # type: ignore[misc]
    with pytest.raises(ConfigError, match=r"^port: must be >= 0, got -1$"):
        Config.from_values({"port": -1}, env={})
    with pytest.raises(ConfigError, match=r"^port: must be >= 0, got -1$"):
        dataclasses.replace(config.http, port=-1)  # a group's construction validates
    with pytest.raises(ConfigError, match="unknown option"):
        Config.from_values({"colour": "red"}, env={})
    # checks across groups run when the Config is put together
    short = dataclasses.replace(config.model, context_length=100)
    limited = dataclasses.replace(config.scheduler, default_max_tokens=200)
    assert dataclasses.replace(config, model=short).model.context_length == 100
    with pytest.raises(ConfigError, match=r"^default_max_tokens: 200 exceeds context_length 100"):
        dataclasses.replace(config, model=short, scheduler=limited)


def test_api_key_stays_out_of_repr() -> None:
    config = load(["--api-key", "sk-secret-123"])
    assert config.http.api_key == "sk-secret-123"
    assert "sk-secret-123" not in repr(config)


def test_help_names_every_flag_and_env_var() -> None:
    text = build_parser().format_help()
    for opt in OPTIONS:
        assert opt.flag in text and opt.env in text, opt.name


def test_bad_flag_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        load(["--no-such-flag"])
    assert exc.value.code == 2
    assert "unrecognized arguments: --no-such-flag" in capsys.readouterr().err


def test_kernels_choice_reaches_the_workers(monkeypatch: pytest.MonkeyPatch) -> None:
    """Workers read their kernels from the environment they inherit: a flag (or a config
    file's value) is put there by the daemon, above any LUCED_KERNELS it started with."""
    from luced.engine.executor import _worker_env
    from luced.serve.daemon import Daemon

    monkeypatch.setenv("LUCED_KERNELS", "native")
    Daemon(load(["--kernels", "torch"]))
    assert _worker_env()["LUCED_KERNELS"] == "torch"


# --- generated documentation ---------------------------------------------------------------


def test_configuration_docs_options_table_is_current() -> None:
    doc = ROOT / "docs" / "configuration.md"
    text = doc.read_text() if doc.exists() else ""
    m = re.search(r"<!-- options:begin -->\n(.*?)<!-- options:end -->", text, re.S)
    assert m, (
        "docs/configuration.md needs the options table between <!-- options:begin --> and "
        "<!-- options:end --> (each marker on its own line): paste "
        "`python -m luced.serve.config markdown`"
    )
    assert m.group(1).strip() == options_markdown().strip(), (
        "docs/configuration.md options table is stale: paste "
        "`python -m luced.serve.config markdown`"
    )


def test_markdown_table_has_every_option() -> None:
    rows = options_markdown().splitlines()
    assert rows[0].count("|") == rows[1].count("|") == 6
    for opt in OPTIONS:
        [row] = [r for r in rows if r.startswith(f"| `{opt.name}` |")]
        assert row.count("|") - row.count("\\|") == 6, row
        assert f"`{opt.env}`" in row


EXAMPLE = ROOT / "systemd" / "luced.toml.example"


def test_example_toml_is_current_and_lists_every_option() -> None:
    text = EXAMPLE.read_text()
    for opt in OPTIONS:
        assert re.search(rf"^#{opt.name} = ", text, re.M), f"{opt.name} missing from {EXAMPLE}"
    assert text == example_toml(), "regenerate: python -m luced.serve.config toml > " + str(EXAMPLE)


@pytest.mark.parametrize("several", [False, True], ids=["MODEL", "models"])
def test_example_toml_values_are_valid(several: bool, tmp_path: Path) -> None:
    # Uncomment every setting: the result must be valid TOML and a valid configuration.
    # MODEL (model, model_name) and several models (models, models_dir) exclude each other.
    skip = ("model", "model_name") if several else ("models", "models_dir")
    text = re.sub(rf"^#(?!(?:{'|'.join(skip)}) = )(\w+ = )", r"\1", EXAMPLE.read_text(), flags=re.M)
    path = tmp_path / "luced.toml"
    path.write_text(text)
    config = load_config(["--config", str(path)], env={}, default_config_path=None)
    assert config.daemon.admin_socket == Path("/run/luced/admin.sock")
    given = {n: src for n, src in config.sources.items() if n not in skip}
    assert all(src.startswith(str(path)) for src in given.values())
    assert config.registry.several == several


def test_draft_ngram_is_the_lookup_drafter() -> None:
    assert load(["--draft", "ngram"]).speculation.lookup_drafts
    assert not load(["--draft", "/models/ngram"]).speculation.lookup_drafts  # a file of that name
    assert not load().speculation.lookup_drafts
    assert load().speculation.adaptive_block_size  # on by default


# --- the groups --------------------------------------------------------------------------


def _field_names(group: type[Options]) -> set[str]:
    return {f.name for f in dataclasses.fields(group)} - {"sources"}


def test_every_option_is_in_exactly_one_group() -> None:
    assert [f.name for f in dataclasses.fields(Config)] == list(GROUPS) == list(GROUP_TYPES)
    for opt in OPTIONS:
        homes = [name for name, group in GROUP_TYPES.items() if opt.name in _field_names(group)]
        assert homes == [opt.group], opt.name
    held = [n for group in GROUP_TYPES.values() for n in _field_names(group)]
    assert sorted(held) == sorted(o.name for o in OPTIONS)


def test_group_fields_are_typed_as_their_rows() -> None:
    for group in GROUP_TYPES.values():
        hints = typing.get_type_hints(group)
        for opt in group.options():
            assert hints[opt.name] == opt.annotation, opt.name


def test_the_import_time_check_catches_a_group_out_of_step() -> None:
    check_group(MoEOptions)

    @dataclasses.dataclass(frozen=True)
    class Missing(Options):
        group: ClassVar[str] = "moe"
        moe_hot_experts: int | None
        moe_routing_profile: Path | None
        moe_expert_device: str | None

    @dataclasses.dataclass(frozen=True)
    class Mistyped(Options):
        group: ClassVar[str] = "moe"
        moe_hot_experts: int  # the row says "all" (None) is a value
        moe_routing_profile: Path | None
        moe_expert_device: str | None
        moe_expert_required: bool

    with pytest.raises(AssertionError, match="differ from the rows of group 'moe'"):
        check_group(Missing)
    with pytest.raises(
        AssertionError,
        match=r"Mistyped\.moe_hot_experts is <class 'int'>, its row says int \| None",
    ):
        check_group(Mistyped)


def test_a_group_is_validated_and_names_its_options_by_source() -> None:
    config = load(["--kv-cache-dir", "/srv/kv"], {"LUCED_KV_FLASH": "auto"})
    kv = config.kv
    assert (kv.label("kv_cache_dir"), kv.label("kv_flash")) == ("--kv-cache-dir", "LUCED_KV_FLASH")
    assert kv.label("kv_cache_budget") == "kv_cache_budget"  # a default: by its name
    assert config.label("kv_flash") == "LUCED_KV_FLASH"
    with pytest.raises(ConfigError, match=r"^LUCED_KV_FLASH: a pool needs tokens"):
        dataclasses.replace(kv, kv_flash=0)
    assert kv.row_dtype("float32") == "float32"
    assert load(["--kv-dtype", "bfloat16"]).effective_kv_dtype() == "bfloat16"
