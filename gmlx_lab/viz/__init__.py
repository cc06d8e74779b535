"""Figures for the notebooks: plotly builders, quantization helpers, cache sizes and published figures.

Importing this module inside a Jupyter kernel whose plotly renderer is the plain
`plotly_mimetype` switches it to `plotly_mimetype+notebook`: JupyterLab still
draws the mimetype (offline, bundled plotly.js), and an HTML export gets the
figure with plotly.js embedded (never the CDN). A renderer you chose is kept.
"""

import plotly.io as _pio

from ..records import record_bytes
from .code import Source, source
from .figures import (
    REGION_COLORS,
    Table,
    affine_row_figure,
    bars_figure,
    bytes_label,
    channel_figure,
    code_histogram,
    draft_figure,
    error_figure,
    experiment_data,
    growth_figure,
    imbalance_figure,
    kl_strip,
    passkey_heatmaps,
    policy_strip,
    record_figure,
    regions_bar,
    regions_stream,
    scheme_color,
    scheme_colors,
    sink_mass_figure,
    table_html,
    weights_kv_figure,
    weights_kv_positions,
    window_stream,
)
from .quant import AffineRow, affine_row, hadamard, normalize_history, quant_error, record_of
from .sizes import LayerShape, layer_bytes, layer_shapes, policy_bytes
from .sources import (
    GMLX_KL_TABLE,
    LLAMA_CPP_ROTATION_PPL,
    REAL_DENSE_CONFIGS,
    benchmark_results,
    dense_bytes_per_token,
    family_curves,
)
from .tradeoff import KL_SCALE, kl_color, kl_legend_html, published_vs_ours_figure, size_figure, tradeoff_figure

__all__ = [
    "GMLX_KL_TABLE", "LLAMA_CPP_ROTATION_PPL", "REAL_DENSE_CONFIGS", "REGION_COLORS", "AffineRow", "LayerShape",
    "Source", "Table", "affine_row", "affine_row_figure", "bars_figure", "benchmark_results", "bytes_label",
    "channel_figure", "code_histogram", "dense_bytes_per_token", "draft_figure", "error_figure", "experiment_data",
    "family_curves", "growth_figure", "hadamard", "imbalance_figure", "kl_strip", "layer_bytes", "layer_shapes",
    "normalize_history", "passkey_heatmaps", "policy_bytes", "policy_strip", "quant_error", "record_bytes",
    "record_figure", "record_of", "regions_bar", "regions_stream", "scheme_color", "scheme_colors",
    "sink_mass_figure", "source", "table_html", "weights_kv_figure", "weights_kv_positions", "window_stream",
]
__all__ += ["KL_SCALE", "kl_color", "kl_legend_html", "published_vs_ours_figure", "size_figure", "tradeoff_figure"]


def _offline_export_renderer() -> None:
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is not None and "IPKernelApp" in shell.config and _pio.renderers.default == "plotly_mimetype":
        _pio.renderers.default = "plotly_mimetype+notebook"


_offline_export_renderer()
