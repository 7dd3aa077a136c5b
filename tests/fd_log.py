"""What a call writes to file descriptor 2: TensorFlow's C++ log, which Python's
``sys.stderr`` capture does not see (shared by the unit and parallel suites)."""
import os
import tempfile


def stderr_of(fn):
    """What ``fn()`` writes to file descriptor 2 (TensorFlow's C++ log)."""
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            fn()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        tmp.seek(0)
        return tmp.read().decode(errors="replace")
