"""What the CLI's options may take (and the --dram-budget parsed where it is given), from the layers that define them (the choices, defaults
and constants the command line shows), so cli/ names no module below the session."""
from __future__ import annotations

from flashllm.format.layout import NATIVE
from flashllm.model.tensor import QUANTIZABLE
from flashllm.runtime.budget_given import Budget, parse_budget
from flashllm.runtime.plan import AUTO_DRAFT, AUTO_ROWS, DRAFT_KINDS, MAX_DRAFT, PREDICTOR_MODES
from flashllm.session.calibration import CALIBRATION_TOKENS, CalibrationOptions
from flashllm.sparsity.activations import CRITERIA
from flashllm.sparsity.corpus import KINDS as CORPORA, MIX

CALIBRATION_CORPORA = (MIX, *CORPORA)        # calibrate --corpus: the mix (default) or one kind
from flashllm.sparsity.predictor import KINDS as PREDICTOR_KINDS

DTYPES = (NATIVE, *QUANTIZABLE, "q4_k")      # convert --dtype; q4_k: a GGUF's Q4_K gate / up rows

__all__ = ["AUTO_DRAFT", "AUTO_ROWS", "Budget", "CALIBRATION_CORPORA", "CALIBRATION_TOKENS",
           "CORPORA", "CRITERIA", "DRAFT_KINDS", "DTYPES", "MAX_DRAFT", "PREDICTOR_KINDS",
           "PREDICTOR_MODES", "CalibrationOptions", "parse_budget"]
