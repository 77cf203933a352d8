"""Server flags, fuzzed: a bad value is one ``error:`` line naming the flag and exit status 2,
before any model is loaded; a value that is accepted is one the server can start with."""

from __future__ import annotations

import math

import pytest

from ktransformers.errors import ConfigError
from ktransformers.server.main import main, parse_settings

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from fuzzing import fuzz_settings  # noqa: E402

INT_FLAGS = ("--cache_lens", "--page_size", "--chunk_size", "--max_batch_size", "--max_queue", "--max_new_tokens",
             "--top_k", "--cpu_infer", "--port", "--max_images", "--max_image_pixels")
FLOAT_FLAGS = ("--prefix_cache_ram_gb", "--prefix_cache_disk_gb", "--max_body_mb", "--temperature", "--top_p",
               "--repetition_penalty", "--max_image_mb")

#: flag values as a user might mistype them: numbers of every size and sign, non-numbers, nan/inf
VALUES = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "", " ", "0x10", "1_000", "2**8", "ten", "1.5", "-0", "+7"]),
    st.text(max_size=8),
)


def _sane(s) -> None:
    """What an accepted setting must be, for the engine and the pool to be built from it."""
    for name in ("cache_lens", "page_size", "chunk_size", "max_batch_size", "max_new_tokens", "cpu_infer"):
        v = getattr(s, name)
        assert v is None or (isinstance(v, int) and v >= 1), (name, v)
    assert s.cache_lens is None or s.cache_lens >= max(16, s.page_size)
    assert s.max_queue >= 0 and 0 < s.port < 65536 and (s.top_k is None or s.top_k >= 0)
    for name in ("prefix_cache_ram_gb", "prefix_cache_disk_gb", "max_body_mb", "temperature", "top_p",
                 "repetition_penalty"):
        v = getattr(s, name)
        assert v is None or (isinstance(v, float) and math.isfinite(v)), (name, v)
    assert s.prefix_cache_ram_gb >= 0 and s.prefix_cache_disk_gb >= 0 and s.max_body_bytes > 0
    assert s.repetition_penalty is None or s.repetition_penalty > 0
    assert s.temperature is None or 0 <= s.temperature <= 2
    assert s.top_p is None or 0 < s.top_p <= 1
    limits = s.image_limits()  # the images' limits: a count of 0 or more, a positive size and pixel count
    assert limits.max_images >= 0 and limits.max_bytes >= 0 and limits.max_pixels >= 1


@fuzz_settings(400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(flag=st.sampled_from(INT_FLAGS + FLOAT_FLAGS), value=VALUES)
def test_fuzz_numeric_flag_named_error_or_a_value_the_server_can_use(tmp_path_factory, flag, value):
    model = tmp_path_factory.getbasetemp()  # any existing folder: paths are checked, not read
    try:
        _sane(parse_settings(["--model_path", str(model), flag, value]))
    except ConfigError as e:
        assert "\n" not in str(e) and str(e).startswith(f"{flag} "), str(e)
    except SystemExit as e:  # argparse: not a number of the flag's type
        assert e.code == 2


@pytest.mark.parametrize("argv, needle", [
    (["--prefix_cache_ram_gb", "nan"], "--prefix_cache_ram_gb nan: must be a finite number"),
    (["--prefix_cache_disk_gb", "inf", "--prefix_cache_dir", "{tmp}"], "--prefix_cache_disk_gb inf: must be a finite"),
    (["--max_body_mb", "1e400"], "--max_body_mb inf: must be a finite number"),
    (["--repetition_penalty", "0"], "--repetition_penalty 0.0: must be positive"),
    (["--cache_lens", "32", "--page_size", "64"], "--cache_lens 32: must hold at least one page"),
    (["--page_size", "0"], "--page_size 0: must be positive"),
    (["--max_batch_size", "many"], "argument --max_batch_size: invalid int value: 'many'"),
    (["--chunk_size", "1.5"], "argument --chunk_size: invalid int value: '1.5'"),
    (["--prefix_cache_dir", "{file}"], "exists and is not a folder"),
    (["--prefix_cache_disk_gb", "1"], "--prefix_cache_disk_gb 1.0: needs --prefix_cache_dir"),
])
def test_bad_batching_flags_exit_2_with_one_line(tmp_path, capsys, argv, needle):
    (tmp_path / "a_file").write_text("x")
    argv = [a.replace("{tmp}", str(tmp_path / "prefix")).replace("{file}", str(tmp_path / "a_file")) for a in argv]
    try:
        status = main(["--model_path", str(tmp_path), "--data_dir", str(tmp_path / "data"), *argv])
    except SystemExit as e:  # argparse's own refusals
        status = e.code
    assert status == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("error: ") and needle in err, err
    assert not (tmp_path / "data").exists()  # refused before anything was created or loaded


#: --database_url values as mistyped: wrong schemes, missing parts, stray characters, all holding a password
DB_PASSWORD = "pw-Zq9"
DATABASE_URLS = st.builds(
    lambda scheme, sep, host, port, db, junk: f"{scheme}{sep}kt:{DB_PASSWORD}@{host}{port}/{db}{junk}",
    st.sampled_from(["postgresql", "postgres", "postgresql+psycopg", "postgresql+psycopg2", "mysql", "sqlite",
                     "", "http", "p%sql"]),
    st.sampled_from(["://", ":/", ":", "//", ""]),
    st.sampled_from(["127.0.0.1", "", "[::1]", "db host", "h@st"]),
    st.sampled_from(["", ":5432", ":x", ":99999", ":"]),
    st.sampled_from(["kt", "", "a/b"]),
    st.one_of(st.text(max_size=6), st.just(f"?password={DB_PASSWORD}"), st.just(f"?sslmode=x&password={DB_PASSWORD}")))


@fuzz_settings(300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(url=DATABASE_URLS)
def test_fuzz_database_url_one_line_without_the_password(tmp_path_factory, url):
    """A --database_url is accepted (its form: connecting is tried at start) or refused in one line
    naming the flag; the password is never in the message."""
    model = tmp_path_factory.getbasetemp()
    try:
        s = parse_settings(["--model_path", str(model), "--database_url", url])
    except ConfigError as e:
        msg = str(e)
        assert "\n" not in msg and msg.startswith("--database_url") and DB_PASSWORD not in msg, msg
    else:
        from ktransformers.server.db import parse_database_url, redact_url

        assert parse_database_url(s.database_url).drivername == "postgresql+psycopg"
        assert DB_PASSWORD not in redact_url(s.database_url)


@fuzz_settings(300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(cache_lens=st.one_of(st.none(), st.integers(16, 2**40)), backend=st.sampled_from(["balance_serve", "ktransformers"]),
       max_positions=st.one_of(st.none(), st.integers(1, 2**24)))
def test_fuzz_planned_context_is_one_the_memory_plan_takes(tmp_path_factory, cache_lens, backend, max_positions):
    """Any accepted --cache_lens on either backend, any model context: the memory plan is asked for
    1 .. the model's max positions tokens (a larger pool is planned at them, never refused as a context)."""
    from types import SimpleNamespace

    from ktransformers.server.main import planned_context

    argv = ["--model_path", str(tmp_path_factory.getbasetemp()), "--backend_type", backend, "--page_size", "16"]
    s = parse_settings(argv + (["--cache_lens", str(cache_lens)] if cache_lens else []))
    limit = max_positions or 4096  # a config without it: 4096, as the plan reads it
    got = planned_context(s, SimpleNamespace(max_position_embeddings=max_positions))
    assert 1 <= got <= limit
    if backend == "ktransformers":  # its context is --cache_lens, else the model's
        assert got == min(cache_lens or limit, limit)
