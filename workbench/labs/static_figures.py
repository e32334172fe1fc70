"""Static PNG images of the labs' figures, drawn from real runs, for the README and reports.

    python -m workbench.labs.static_figures docs/img

Runs chapter 2's comparison (the lab trace through the paged and four contiguous allocators on
the bundled model) and writes ``waste_bars.png``, ``memory_timeline_paged.png``,
``memory_timeline_orca-pow2.png`` and ``block_map_orca-pow2.png``. Images are rendered by kaleido,
which drives a local Chromium (Debian's ``chromium`` works offline; kaleido finds it on ``PATH``,
or set ``BROWSER_PATH``).
"""

from __future__ import annotations

import sys
from pathlib import Path

__all__ = ["write_png", "main"]


def write_png(fig, path: str | Path, width: int = 1000, height: int = 500) -> Path:
    """Write ``fig`` as a PNG (pixels ``width`` x ``height``).

    Raises:
        ImportError: kaleido is missing (``pip install 'workbench[figures]'``).
        RuntimeError: kaleido found no Chromium/Chrome (install Debian's ``chromium`` or set ``BROWSER_PATH``).
    """
    try:
        import kaleido  # noqa: F401
    except ImportError:
        raise ImportError("static images need kaleido: pip install 'workbench[figures]'") from None
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        fig.write_image(str(path), width=width, height=height)
    except Exception as e:  # kaleido's own error types vary by version
        if "chrom" in str(e).lower() or "browser" in str(e).lower():
            raise RuntimeError(
                f"kaleido could not start a Chromium ({e}); install one (apt-get install chromium) or set BROWSER_PATH"
            ) from e
        raise
    return path


def main(argv: list[str] | None = None) -> int:
    from workbench.labs.ch02_fragmentation_live import compare_allocators
    from workbench.labs.runs import lab_trace, memory_timeline, waste_figure
    from workbench.viz.figures import block_map_figure

    args = sys.argv[1:] if argv is None else argv
    out = Path(args[0] if args else "docs/img")
    results = compare_allocators(records=lab_trace(), num_gpu_blocks_override=48, block_map_every=2)
    written = [write_png(waste_figure(results), out / "waste_bars.png", 1100, 520)]
    for name in ("paged", "orca-pow2"):
        fig = memory_timeline(results[name], f"{name}: the KV pool over the run (lab trace, 48 blocks)")
        written.append(write_png(fig, out / f"memory_timeline_{name}.png", 1000, 450))
    maps = results["orca-pow2"].recorder.block_maps
    if maps:
        fig = block_map_figure(maps, max_cols=16, active=len(maps) // 3)
        written.append(write_png(fig, out / "block_map_orca-pow2.png", 900, 520))
    for p in written:
        print(p)
    return 0


if __name__ == "__main__":
    sys.exit(main())
