"""Choosing the kernels' instruction-set variant at import (rudra_zmq.kernels): the best one
this CPU runs, RUDRA_ZMQ_KERNELS to force one, a clear error for one that cannot run here, the
choice logged once and named by ``--version``."""

import os
import subprocess
import sys

import pytest

import rudra_zmq
from rudra_zmq import kernels
from rudra_zmq.kernels import variants as kv

V3_CPU = frozenset(kv.VARIANTS["avx2"][1])  # an AVX2 machine (x86-64-v3), no AVX-512
V4_CPU = frozenset(kv.VARIANTS["avx512"][1])


def _python(code, **env):
    """Run ``code`` in a fresh interpreter with ``env`` added (None: removed); (rc, out, err)."""
    full = {k: v for k, v in os.environ.items() if k != kv.ENV}
    for k, v in env.items():
        if v is None:
            full.pop(k, None)
        else:
            full[k] = v
    res = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=full
    )
    return res.returncode, res.stdout, res.stderr


def test_a_cpu_runs_the_variants_whose_features_it_has_best_first():
    assert kv.runnable(V4_CPU) == ["avx512", "avx2", "baseline"]
    assert kv.runnable(V3_CPU) == ["avx2", "baseline"]
    assert kv.runnable(frozenset()) == ["baseline"]  # another architecture, or no cpuid


def test_avx512_needs_the_os_to_save_the_zmm_registers():
    """A CPU with AVX-512 under an OS or hypervisor that does not enable its state (XCR0)."""
    assert kv.runnable(V4_CPU - {"os_avx512"}) == ["avx2", "baseline"]
    assert kv.missing("avx512", V4_CPU - {"os_avx512", "avx512bw"}) == ["avx512bw", "os_avx512"]
    assert kv.runnable(V4_CPU - {"os_avx"}) == ["baseline"]


def test_this_x86_cpu_reports_what_numpy_itself_requires():
    if not kernels.CPU_FEATURES:
        pytest.skip("not an x86 CPU (or no cpuid): only the baseline is built")
    assert not kv.missing("baseline", kernels.CPU_FEATURES)
    assert set(kv.VARIANTS["avx2"][1][:7]) <= kernels.CPU_FEATURES  # x86-64-v2, as numpy needs


def test_the_default_is_the_best_variant_this_cpu_runs():
    info = rudra_zmq.build_info()
    assert info["variant"] == kernels.available_variants()[0] == kernels.VARIANT
    assert info["variants_available"] == kernels.available_variants()
    assert set(info["variants_available"]) <= set(info["variants_built"])
    assert kv.BASELINE in info["variants_available"]


@pytest.mark.parametrize("variant", kv.VARIANTS)
def test_the_environment_forces_a_variant(variant):
    if variant not in kernels.available_variants():
        pytest.skip(f"this CPU or build has no {variant} kernels")
    rc, out, err = _python(
        "import rudra_zmq; i = rudra_zmq.build_info(); print(i['variant'], i['module_file'])",
        RUDRA_ZMQ_KERNELS=variant,
    )
    assert rc == 0, err
    name, path = out.split()
    assert name == variant and os.path.basename(path).startswith(f"_{variant}.")


def test_an_unknown_variant_stops_with_one_line_that_lists_the_choices():
    rc, out, err = _python("import rudra_zmq", RUDRA_ZMQ_KERNELS="avx3")
    assert rc == 2 and out == ""
    assert err == (
        "rudra_zmq: error: RUDRA_ZMQ_KERNELS=avx3: 'avx3' is not a kernel variant; "
        "pick one of avx512, avx2, baseline (or auto)\n"
    )


def test_the_command_refuses_an_unknown_variant_without_a_traceback():
    rc, out, err = _python(
        "import sys; sys.argv = ['rudra-zmq', '--version']\nfrom rudra_zmq.cli import main; main()",
        RUDRA_ZMQ_KERNELS="AVX-2",
    )
    assert rc == 2 and out == ""
    assert err.splitlines() == [
        "rudra_zmq: error: RUDRA_ZMQ_KERNELS=AVX-2: 'avx-2' is not a kernel variant; "
        "pick one of avx512, avx2, baseline (or auto)"
    ]


def test_a_forced_variant_this_cpu_lacks_stops_with_one_line_naming_what_runs():
    lacking = [v for v in kv.VARIANTS if v not in kernels.available_variants()]
    if not lacking:
        pytest.skip("this CPU and build run every variant")
    rc, _, err = _python("import rudra_zmq", RUDRA_ZMQ_KERNELS=lacking[0])
    assert rc == 2 and len(err.splitlines()) == 1 and "Traceback" not in err
    assert err.startswith(f"rudra_zmq: error: RUDRA_ZMQ_KERNELS={lacking[0]}: ")
    assert err.rstrip().endswith(", ".join(kernels.available_variants()))


def test_auto_and_empty_mean_the_best():
    for value in ("auto", "", " AUTO "):
        rc, out, err = _python(
            "import rudra_zmq; print(rudra_zmq.build_info()['variant'])", RUDRA_ZMQ_KERNELS=value
        )
        assert rc == 0 and out.strip() == kernels.VARIANT, (value, err)


def test_a_variant_this_cpu_lacks_is_refused_naming_what_is_missing(monkeypatch):
    """Never a silent fallback: a forced benchmark must measure what it names."""
    monkeypatch.setattr(kernels, "CPU_FEATURES", V3_CPU)
    with pytest.raises(ImportError, match=r"the avx512 kernels need avx512f, avx512bw, .*lacks"):
        kernels.load_variant("avx512")
    monkeypatch.setattr(kernels, "CPU_FEATURES", frozenset())
    with pytest.raises(ImportError, match=r"it runs baseline$"):
        kernels.load_variant("avx2")


def test_a_variant_this_install_did_not_build_is_refused(monkeypatch):
    """A compiler that rejected -march=x86-64-v4 built no avx512 kernels (setup.py says so)."""
    monkeypatch.setattr(kernels, "built_variants", lambda: ["avx2", "baseline"])
    monkeypatch.setattr(kernels, "CPU_FEATURES", V4_CPU)
    with pytest.raises(ImportError, match="this install has no avx512 kernels"):
        kernels.load_variant("avx512")
    assert kernels.available_variants() == ["avx2", "baseline"]


def test_the_choice_is_logged_once_at_info():
    rc, _, err = _python(
        "import logging; logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s')\n"
        "import rudra_zmq, rudra_zmq.kernels, rudra_zmq.codec\n"
        "import importlib; importlib.import_module('rudra_zmq.kernels')"
    )
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("rudra_zmq.kernels ")]
    assert len(lines) == 1, err
    assert lines[0].startswith(f"rudra_zmq.kernels kernels: {kernels.VARIANT} variant (the best")


def test_the_choice_is_quiet_unless_logging_asks():
    rc, out, err = _python("import rudra_zmq")
    assert rc == 0 and out == "" and err == "", err


def test_version_names_the_variant_in_use():
    rc, out, err = _python(
        "import sys; sys.argv = ['rudra-zmq', '--version']\nfrom rudra_zmq.cli import main; main()",
        RUDRA_ZMQ_KERNELS="baseline",
        COLUMNS="200",
    )
    assert rc == 0, err
    assert out.startswith(f"rudra-zmq {rudra_zmq.__version__} (kernels: baseline variant, -O3")


def test_a_process_that_configures_logging_after_import_logs_the_choice_once():
    """A role process imports the package before it configures logging (role_process.serve):
    log_choice() then logs the choice, once however often it is called."""
    rc, _, err = _python(
        "import logging, rudra_zmq\n"
        "logging.basicConfig(level=logging.INFO, format='%(name)s %(message)s')\n"
        "rudra_zmq.kernels.log_choice(); rudra_zmq.kernels.log_choice()",
        RUDRA_ZMQ_KERNELS="baseline",
    )
    assert rc == 0, err
    lines = [ln for ln in err.splitlines() if ln.startswith("rudra_zmq.kernels ")]
    assert lines == ["rudra_zmq.kernels kernels: baseline variant (forced by RUDRA_ZMQ_KERNELS)"]
