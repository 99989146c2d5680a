"""
kvcal's C++ library and runtime (see the kvcal package for the documented API)
"""

from collections.abc import Sequence
from typing import Annotated

import numpy
from numpy.typing import NDArray


class Error(ValueError):
    pass

class Certificate:
    """The spectral certificate of a mask (HEX §3.2, App. A.1)."""

    @property
    def row_degree(self) -> int:
        """d1 (maximum row degree)"""

    @property
    def col_degree(self) -> int:
        """d2 (maximum column degree)"""

    @property
    def biregular(self) -> bool: ...

    @property
    def sigma1(self) -> float:
        """largest singular value"""

    @property
    def sigma2(self) -> float:
        """second singular value"""

    @property
    def ramanujan_bound(self) -> float:
        """tau = sqrt(d1 - 1) + sqrt(d2 - 1)"""

    @property
    def ramanujan(self) -> bool:
        """sigma2 <= tau proven"""

    @property
    def kind(self) -> str:
        """'exact', 'probabilistic' or 'none'"""

    @property
    def margin(self) -> float:
        """tau - sigma2"""

    @property
    def failure_probability(self) -> float: ...

    @property
    def estimate_converged(self) -> bool: ...

    @property
    def lanczos_steps(self) -> int: ...

    def __repr__(self) -> str: ...

class MaskRecord:
    """
    One mask of a kvcal.masks file: the CSR (indptr int64 [rows+1], indices int32 [nnz]) and what it claims.
    """

    def __init__(self, rows: int, cols: int, indptr: Annotated[NDArray, dict(writable=False)], indices: Annotated[NDArray, dict(writable=False)], certificate: Certificate, id: str = 'mask_0000', method: str = 'random', seed: int = 0) -> None:
        """A record to write with write_masks (the arrays are copied)."""

    @property
    def id(self) -> str: ...

    @id.setter
    def id(self, arg: str, /) -> None: ...

    @property
    def rows(self) -> int: ...

    @property
    def cols(self) -> int: ...

    @property
    def nnz(self) -> int: ...

    @property
    def indptr(self) -> Annotated[NDArray[numpy.int64], dict(writable=False)]:
        """int64 [rows + 1], a read-only view (no copy)"""

    @property
    def indices(self) -> Annotated[NDArray[numpy.int32], dict(writable=False)]:
        """int32 [nnz], a read-only view (no copy)"""

    @property
    def method(self) -> str: ...

    @property
    def seed(self) -> int: ...

    @property
    def certificate(self) -> Certificate: ...

    @property
    def lps_p(self) -> int: ...

    @property
    def lps_q(self) -> int: ...

    @property
    def construction(self) -> str: ...

    @property
    def certificate_theorem(self) -> str: ...

    @property
    def transposed(self) -> bool: ...

    @property
    def lift_seeds(self) -> list[int]: ...

    def __repr__(self) -> str: ...

class MaskFile:
    """A kvcal.masks file as read."""

    @property
    def format_version(self) -> int: ...

    @property
    def kvcal_version(self) -> str: ...

    @property
    def command_line(self) -> str: ...

    @property
    def created_utc(self) -> str: ...

    @property
    def masks(self) -> list[MaskRecord]: ...

class Verification:
    """What mask-certify re-derives for one record."""

    @property
    def ok(self) -> bool:
        """no stored claim is false"""

    @property
    def false_claims(self) -> list[str]: ...

    @property
    def recertified(self) -> bool: ...

    @property
    def recomputed(self) -> Certificate: ...

    @property
    def structure_problems(self) -> list[str]: ...

def generate_masks(rows: int = 0, cols: int = 0, *, row_degree: int | None = None, sparsity: float | None = None, method: str = 'random', seed: int = 1, count: int = 1, tries: int = 16, lps_p: int = 0, lps_q: int = 0, construction: str = '', transpose: bool = False, lift_to: int = 0, allow_non_ramanujan: bool = False, exact_limit: int = 8192, max_failure_probability: float = 1e-09, threads: int = 0) -> list[MaskRecord]:
    """
    Certified expander masks, as `kvcal mask-gen` makes them (same options and seeds: byte-identical CSR).
    Method 'random' or 'lift' takes rows, cols and one of row_degree / sparsity; method 'lps' takes lps_p,
    lps_q and construction. transpose, lift_to (certified 2-lifts), count distinct masks, tries per mask.
    Returns a list of MaskRecord; raises kvcal.Error when no candidate certifies (allow_non_ramanujan
    keeps the best instead).
    """

def certify(rows: int, cols: int, indptr: Annotated[NDArray, dict(writable=False)], indices: Annotated[NDArray, dict(writable=False)], *, exact_limit: int = 8192, max_failure_probability: float = 1e-09, threads: int = 0) -> Certificate:
    """
    The spectral certificate of a CSR mask (indptr int64 [rows+1], indices int32 [nnz], ascending per row).
    """

def verify(record: MaskRecord, *, exact_limit: int = 8192, threads: int = 0) -> Verification:
    """
    Re-derives every claim stored with a mask record from its CSR (what `kvcal mask-certify` checks).
    """

def read_masks(path: str) -> MaskFile:
    """Reads a kvcal.masks file (every record with its stored claims)."""

def write_masks(path: str, masks: Sequence[MaskRecord], command_line: str = 'kvcal (Python) write_masks') -> None:
    """
    Writes mask records to a kvcal.masks file atomically (temporary file, then rename).
    """

class HeadProfile:
    """
    HeteroCache head roles and budgets (arrays [layers, kv_heads], read-only views).
    """

    @property
    def model(self) -> str: ...

    @property
    def layers(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def q_heads(self) -> int: ...

    @property
    def num_samples(self) -> int: ...

    @property
    def stability(self) -> Annotated[NDArray[numpy.float32], dict(writable=False)]: ...

    @property
    def similarity(self) -> Annotated[NDArray[numpy.float32], dict(writable=False)]: ...

    @property
    def budget_ratio(self) -> Annotated[NDArray[numpy.float32], dict(writable=False)]: ...

    @property
    def role(self) -> Annotated[NDArray[numpy.int8], dict(writable=False)]:
        """int8: 1 anchor, 2 volatile, 3 pivot, 4 satellite"""

    @property
    def pivot(self) -> Annotated[NDArray[numpy.int32], dict(writable=False)]: ...

    @property
    def pairwise(self) -> Annotated[NDArray[numpy.float32], dict(writable=False)]: ...

    @property
    def tau_drift(self) -> float: ...

    @property
    def dump_sha256(self) -> list[str]: ...

def profile_heads(dumps: Sequence[str], *, tau_stable: float = 0.5, tau_sim: float = 0.5, tau_drift: float | None = None, drift_window: int = 8, topk: int = 1024, topk_frac: float = 0.0, pool: int = 5, budget: float = 0.5, gqa: str = 'mean', order: str = 'appendix', threads: int = 0, out: str | None = None, command_line: str = 'kvcal (Python) profile_heads') -> HeadProfile:
    """
    HeteroCache head roles and budgets from attention dumps, as `kvcal profile-heads` (same defaults).
    Writes the kvcal.head_profile artifact to `out` when given.
    """

def read_head_profile(path: str) -> HeadProfile:
    """Reads a kvcal.head_profile file."""

class EntropyCalibration:
    """CHESS re-selection thresholds and the page statistics."""

    @property
    def entropy_threshold(self) -> float: ...

    @property
    def varentropy_threshold(self) -> float: ...

    @property
    def trigger_rate(self) -> float: ...

    @property
    def num_pages(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...

    @property
    def page_entropy(self) -> Annotated[NDArray[numpy.float64], dict(writable=False)]: ...

    @property
    def page_varentropy(self) -> Annotated[NDArray[numpy.float64], dict(writable=False)]: ...

    @property
    def entropy_edges(self) -> Annotated[NDArray[numpy.float64], dict(writable=False)]: ...

    @property
    def varentropy_edges(self) -> Annotated[NDArray[numpy.float64], dict(writable=False)]: ...

    @property
    def histogram(self) -> Annotated[NDArray[numpy.float64], dict(writable=False)]: ...

    @property
    def input_sha256(self) -> list[str]: ...

    @property
    def sources(self) -> list[str]: ...

def calibrate_entropy(dumps: Sequence[str], *, page_size: int = 32, percentile: float = 99.0, rule: str = 'and', page_varentropy: str = 'mean', unit: str = 'nats', partial_pages: str = 'drop', bins: int = 64, threads: int = 0, out: str | None = None, command_line: str = 'kvcal (Python) calibrate_entropy') -> EntropyCalibration:
    """
    CHESS entropy/varentropy thresholds from dumps, as `kvcal calibrate-entropy` (same defaults).
    Writes the kvcal.entropy_calibration artifact to `out` when given.
    """

class Mask:
    """
    An immutable runtime expander mask (CSR, rows = block tokens, cols = channels).
    """

    def __init__(self, rows: int, cols: int, indptr: Annotated[NDArray, dict(writable=False)], indices: Annotated[NDArray, dict(writable=False)]) -> None:
        """
        A mask from CSR arrays (copied); the caches check its structure when they take it.
        """

    @property
    def rows(self) -> int: ...

    @property
    def cols(self) -> int: ...

    @property
    def row_degree(self) -> int: ...

    @property
    def ramanujan(self) -> bool: ...

    @property
    def sigma2(self) -> float: ...

    @property
    def ramanujan_bound(self) -> float: ...

    @property
    def source(self) -> str: ...

    @property
    def nnz(self) -> int: ...

    @property
    def sparsity(self) -> float: ...

    @property
    def nbytes(self) -> int: ...

    @property
    def indptr(self) -> Annotated[NDArray[numpy.int64], dict(writable=False)]:
        """int64 [rows + 1], read-only view"""

    @property
    def indices(self) -> Annotated[NDArray[numpy.int32], dict(writable=False)]:
        """int32 [nnz], read-only view"""

    def __repr__(self) -> str: ...

class HeadTable:
    """
    The bundle's head profile; arrays [layers, kv_heads] (read-only views).
    """

    @property
    def layers(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def q_heads(self) -> int: ...

    @property
    def role(self) -> Annotated[NDArray[numpy.int8], dict(writable=False)]:
        """int8: 1 anchor, 2 volatile, 3 pivot, 4 satellite"""

    def role_name(self, layer: int, head: int) -> str: ...

    @property
    def pivot(self) -> Annotated[NDArray[numpy.int32], dict(writable=False)]: ...

    @property
    def stability(self) -> Annotated[NDArray[numpy.float32], dict(writable=False)]: ...

    @property
    def similarity(self) -> Annotated[NDArray[numpy.float32], dict(writable=False)]: ...

    @property
    def budget_ratio(self) -> Annotated[NDArray[numpy.float32], dict(writable=False)]: ...

    @property
    def budget(self) -> float: ...

    @property
    def tau_stable(self) -> float: ...

    @property
    def tau_sim(self) -> float: ...

    @property
    def tau_drift(self) -> float: ...

    @property
    def drift_window(self) -> int: ...

    @property
    def topk(self) -> int: ...

    @property
    def topk_frac(self) -> float: ...

    @property
    def pool_kernel(self) -> int: ...

class EntropyThresholds:
    """The CHESS re-selection thresholds of a bundle."""

    @property
    def entropy(self) -> float: ...

    @property
    def varentropy(self) -> float: ...

    @property
    def rule_both(self) -> bool: ...

    @property
    def unit_bits(self) -> bool: ...

    @property
    def page_size(self) -> int: ...

    @property
    def varentropy_temporal(self) -> bool: ...

    @property
    def percentile(self) -> float: ...

    @property
    def calibration_trigger_rate(self) -> float: ...

class Bundle:
    """
    A validated, read-only model bundle (kvcal.bundle); open with Bundle.open(path).
    """

    @staticmethod
    def open(path: str) -> Bundle:
        """Opens and validates a bundle; kvcal.Error names the first problem."""

    def close(self) -> None:
        """Releases the bundle; later use raises ValueError."""

    @property
    def closed(self) -> bool: ...

    def __enter__(self) -> object: ...

    def __exit__(self, *args) -> None: ...

    @property
    def path(self) -> str: ...

    @property
    def model(self) -> str: ...

    @property
    def masks(self) -> list[Mask]: ...

    def find_mask(self, rows: int, cols: int, sparsity: float) -> Mask | None:
        """The bundle's mask for a shape, or None."""

    @property
    def heads(self) -> HeadTable: ...

    @property
    def entropy(self) -> EntropyThresholds: ...

class MaskCache:
    """
    Thread-safe LRU cache of expander masks: from memory, else an attached bundle, else generated and certified on the fly.
    """

    def __init__(self, capacity: int = 16, method: str = 'lift', seed: int = 461547725164, tries: int = 16, require_ramanujan: bool = True, threads: int = 1) -> None: ...

    def attach(self, bundle: Bundle) -> None:
        """
        Misses look in the bundle before generating (the cache keeps it alive).
        """

    def get(self, rows: int, cols: int, sparsity: float) -> Mask: ...

    @property
    def stats(self) -> dict: ...

    def __len__(self) -> int: ...

    @property
    def capacity(self) -> int: ...

class HexLayerCache:
    """
    The streaming HEX cache of one layer (every KV head): fp16, kcvtB, h2oB, expanderB, hexB.
    """

    def __init__(self, kv_heads: int, head_dim: int, method: str = 'hex4', mask: Mask | None = None, *, block: int = 96, hh_ratio: float = 0.02, recent_window: int = 8, sparsity: float = 0.03125, mode: str = 'append') -> None: ...

    def append(self, k: Annotated[NDArray, dict(writable=False)], v: Annotated[NDArray, dict(writable=False)]) -> None:
        """k, v: float16 [kv_heads, n, head_dim] (read in place)."""

    def observe(self, attn: Annotated[NDArray, dict(writable=False)]) -> None:
        """
        attn: float32 [heads, tokens], weights added to the heavy-hitter scores.
        """

    def attend(self, q: Annotated[NDArray, dict(writable=False)], *, scale: float | None = None, out: object | None = None, return_probs: bool = False) -> object:
        """
        q: float32 [q_heads, head_dim]; returns out [q_heads, head_dim] (written into `out` when given), and the weights [q_heads, tokens] with return_probs.
        """

    def dequantize(self, first_token: int = 0) -> tuple[NDArray[numpy.float32], NDArray[numpy.float32]]:
        """
        The compressed blocks' keys and values as the runtime decodes them, float32 [kv_heads, n, head_dim], from first_token (a block boundary) to compressed_tokens.
        """

    @property
    def tokens(self) -> int: ...

    @property
    def compressed_tokens(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def head_dim(self) -> int: ...

    @property
    def block(self) -> int: ...

    @property
    def bits(self) -> int: ...

    def bytes(self) -> int:
        """stored bytes: blocks + fp16 residual"""

    def fp16_bytes(self) -> int:
        """the same tokens in fp16"""

class H2OEvictCache:
    """
    The original H2O eviction policy (heavy hitters + recent tokens, the rest dropped).
    """

    def __init__(self, kv_heads: int, q_heads: int, head_dim: int, budget: float) -> None: ...

    def append(self, k: Annotated[NDArray, dict(writable=False)], v: Annotated[NDArray, dict(writable=False)]) -> None: ...

    def observe(self, attn: Annotated[NDArray, dict(writable=False)]) -> None:
        """attn: float32 [q_heads, tokens]"""

    def attend(self, q: Annotated[NDArray, dict(writable=False)], *, scale: float | None = None, out: object | None = None, return_probs: bool = False) -> object: ...

    @property
    def tokens(self) -> int: ...

    def kept(self, head: int) -> int: ...

    def bytes(self) -> int: ...

    def fp16_bytes(self) -> int: ...

class ChessIndex:
    """CHESS page summaries of one request and its hierarchical selection."""

    def __init__(self, dim: int, *, preset: str | None = None, page_size: int = 32, chunk_pages: int = 4, grid_chunks: int = 4, rho_grid: float | None = None, rho_chunk: float | None = None, rho_page: float | None = None, sink_pages: int = 1, recent_pages: int = 2) -> None:
        """
        dim = layers * kv_heads * head_dim; preset 'conservative', 'moderate' (default ratios) or 'aggressive'.
        """

    def append(self, keys: Annotated[NDArray, dict(writable=False)]) -> None:
        """
        keys: float32 or float16 [n, dim] (layer-major, then KV head, then channel).
        """

    @property
    def dim(self) -> int: ...

    @property
    def tokens(self) -> int: ...

    @property
    def pages(self) -> int: ...

    @property
    def chunks(self) -> int: ...

    @property
    def grids(self) -> int: ...

    def summaries(self) -> NDArray[numpy.float32]:
        """
        A copy of the summary store [rows, dim] (the store moves as pages complete).
        """

    def page_row(self, page: int) -> int: ...

    def chunk_row(self, chunk: int) -> int: ...

    def grid_row(self, grid: int) -> int: ...

    def anchor(self) -> NDArray[numpy.float32]: ...

    def select(self, anchor: Annotated[NDArray, dict(writable=False)] | None = None) -> NDArray[numpy.int32]:
        """
        Selected complete pages (int32, ascending) against anchor() or the given anchor [dim].
        """

def select_batch(requests: Sequence[ChessIndex]) -> tuple:
    """
    The paged-attention layout (indptr, indices, last_page_len) of a batch's selections.
    """

class ReselectionTrigger:
    """
    When to select again: per page of generated tokens, entropy and varentropy against the calibrated thresholds.
    """

    def __init__(self, entropy_threshold: float, varentropy_threshold: float, *, rule_both: bool = True, varentropy_temporal: bool = False, page_size: int = 32, unit_bits: bool = False) -> None: ...

    @staticmethod
    def from_bundle(bundle: Bundle) -> ReselectionTrigger: ...

    def push(self, entropy: float, varentropy: float) -> bool:
        """
        One generated token's entropy and varentropy (nats); True when it completes a page that triggers.
        """

    @property
    def pages(self) -> int: ...

    @property
    def triggered(self) -> int: ...

class HeteroPlan:
    """Budgets of one context length; arrays [layers, kv_heads]."""

    @property
    def layers(self) -> int: ...

    @property
    def kv_heads(self) -> int: ...

    @property
    def context(self) -> int: ...

    @property
    def full(self) -> Annotated[NDArray[numpy.uint8], dict(writable=False)]: ...

    @property
    def budget(self) -> Annotated[NDArray[numpy.int64], dict(writable=False)]: ...

    @property
    def pivot(self) -> Annotated[NDArray[numpy.int32], dict(writable=False)]: ...

    @property
    def satellites(self) -> list[list[int]]: ...

    @property
    def l_base(self) -> int: ...

    @property
    def tau_drift(self) -> float: ...

    @property
    def window(self) -> int: ...

    @property
    def compressed_heads(self) -> int: ...

    @property
    def budget_sum(self) -> int: ...

def make_hetero_plan(heads: HeadTable, context: int, window: int = 8) -> HeteroPlan: ...

class DriftStep:
    @property
    def overlap(self) -> float: ...

    @property
    def checked(self) -> bool: ...

    @property
    def median(self) -> float: ...

    @property
    def drift(self) -> bool: ...

class DriftMonitor:
    """One pivot head's drift monitor (HeteroCache Algorithm 1)."""

    def __init__(self, l_base: int, window: int, tau_drift: float) -> None: ...

    def init(self, prefill_attention: Annotated[NDArray, dict(writable=False)]) -> None:
        """float32 [n]: the pivot's prefill attention"""

    def step(self, attention: Annotated[NDArray, dict(writable=False)]) -> DriftStep:
        """float32 [n]: this decode step's attention"""

    @property
    def base(self) -> NDArray[numpy.int32]:
        """the current base set (a copy)"""

    @property
    def steps(self) -> int: ...

    @property
    def drifts(self) -> int: ...
