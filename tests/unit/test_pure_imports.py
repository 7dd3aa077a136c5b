"""The pure modules import in a Python where TensorFlow, Keras and Horovod
cannot be imported: the process grid and its geometry, the oracle
(formulas, machine files, predictions), the strategy table, the error
template, the config and the shipped docs. `import tfhybrid` itself is also
TensorFlow-free until a TF-dependent name is touched."""
import subprocess
import sys
import textwrap

PURE = ["tfhybrid", "tfhybrid.process_grid", "tfhybrid.spatial_geometry",
        "tfhybrid.strategy_names", "tfhybrid.errors", "tfhybrid._compat", "tfhybrid.config",
        "tfhybrid.oracle", "tfhybrid.oracle.formulas", "tfhybrid.oracle.machine",
        "tfhybrid.oracle.api", "tfhybrid.oracle.record", "tfhybrid.oracle.strategies",
        "tfhybrid.oracle.calibration.fit", "tfhybrid.docs", "tfhybrid.launch_hosts"]

BLOCKER = textwrap.dedent("""
    import importlib.abc, sys
    class Block(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in ("tensorflow", "keras", "horovod", "tf_keras"):
                raise ImportError(f"{name} is not installed in this Python (test)")
            return None
    sys.meta_path.insert(0, Block())
""")


def test_pure_modules_import_without_tensorflow():
    code = BLOCKER + textwrap.dedent(f"""
        import importlib
        for name in {PURE!r}:
            importlib.import_module(name)
        from tfhybrid.oracle import predict
        from tfhybrid.oracle.profile import LayerRow, ModelProfile
        prof = ModelProfile("m", (LayerRow("fc", "dense", 8, 8, 0, 16, 32, 4, 2, 4, 2),), 4)
        assert predict(prof, "d", 2, 8, {{"alpha": 0, "beta": 0, "flop_rate": 1.0}}).feasible
        import tfhybrid
        assert tfhybrid.ProcessGrid(size=4, rank=1, model_parallel=2).model_size == 2
        bad = [m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras", "horovod")]
        assert not bad, bad
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


def test_the_blocker_blocks():
    """The check above can fail: the TF-dependent API is refused by the blocker."""
    code = BLOCKER + "import tfhybrid\ntfhybrid.transform\n"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode != 0 and "is not installed in this Python" in out.stderr
