"""expcache: a GPU expert cache for streaming Mixture-of-Experts inference.

The public API::

    from pyexpcache import ExpertCache, ModelLayout, HostSource

    layout = ModelLayout.preset("mixed")            # DeepSeek V4 Flash q2-q4
    with HostSource(layout, pinned=True) as source, \\
         ExpertCache(layout, source, budget_bytes=12 << 30) as cache:
        ptrs = cache.select(layer=5, expert_ids=[3, 17, 80, 81, 200, 7], stream=my_stream)
        ...                                         # launch kernels reading ptrs on my_stream
        print(cache.stats().hit_rate)
"""

__version__ = "0.3.0"  # before the imports: submodules read it

from ._errors import (
    ArgumentRangeError,
    CacheClosedError,
    CudaError,
    ExpcacheError,
    ExpcacheWarning,
    ForkedError,
    InternalError,
    InvalidArgumentError,
    InvalidStateError,
    OutOfDeviceMemoryError,
    OutOfHostMemoryError,
    PoisonedError,
    SourceIOError,
    UnsupportedError,
)
from .bank import ExpertBank
from .batch import Batch, CompactBuffer, CompactRegion
from .cache import ExpertCache, staging_defaults
from .file_source import FileSource
from .gguf import GGUFSource
from .layer_spec import LayerSpec, PartSpec
from .layout import ModelLayout
from .layout_file import LayoutFileError
from .multi import DeviceBatch, DeviceSelection, MultiDeviceCache
from .placement import Placement, loads_from_calls
from .quant import matrix_bytes
from .selection import Selection
from .source import BufferSource, HostSource, LayerPlacement, Source, checksum_bytes
from .stats import CacheStats, ClassInfo, ClassStats, PathStats, PoolStats, PrefetchStats, StagingStats
from .views import ExpertView, TensorView

# Every public name: the caches, their options' types and what their methods return (so an engine
# can annotate with them), the sources, the exceptions. The test hooks are pyexpcache.testing's.
__all__ = [
    "ArgumentRangeError",
    "Batch",
    "BufferSource",
    "CacheClosedError",
    "CacheStats",
    "ClassInfo",
    "ClassStats",
    "CompactBuffer",
    "CompactRegion",
    "CudaError",
    "DeviceBatch",
    "DeviceSelection",
    "ExpcacheError",
    "ExpcacheWarning",
    "ExpertBank",
    "ExpertCache",
    "ExpertView",
    "FileSource",
    "ForkedError",
    "GGUFSource",
    "HostSource",
    "InternalError",
    "InvalidArgumentError",
    "InvalidStateError",
    "LayerPlacement",
    "LayerSpec",
    "LayoutFileError",
    "ModelLayout",
    "MultiDeviceCache",
    "OutOfDeviceMemoryError",
    "OutOfHostMemoryError",
    "PartSpec",
    "PathStats",
    "Placement",
    "PoisonedError",
    "PoolStats",
    "PrefetchStats",
    "Selection",
    "Source",
    "SourceIOError",
    "StagingStats",
    "TensorView",
    "UnsupportedError",
    "checksum_bytes",
    "library_version",
    "loads_from_calls",
    "matrix_bytes",
    "staging_defaults",
]


def library_version() -> str:
    """The loaded libexpcache's version and path."""
    from ._lib import lib, library_path  # loads the library: not at import (every --help runs without it)

    v = lib.expcache_version()
    return f"{v // 10000}.{v // 100 % 100}.{v % 100} ({library_path})"
