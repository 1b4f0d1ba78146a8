"""Side by side with the published implementations of KDEformer, Scatterbrain, Reformer
and Skyformer (with the Skyformer release's Nystromformer and Informer).

    KDEFORMER_OFFICIAL=~/src/kdeformer python benchmarks/published.py kdeformer
    FLY_OFFICIAL=~/src/fly python benchmarks/published.py scatterbrain
    pip install --target ~/rp --no-deps reformer-pytorch ...   # or install it normally
    REFORMER_PYTORCH=~/rp python benchmarks/published.py reformer
    SKYFORMER_OFFICIAL=~/src/Skyformer python benchmarks/published.py skyformer \
        --seq-lens 512 --features 32 64 128 --layers 0 3 --seeds 0 1 2 3 4
    python benchmarks/published.py reformer --seq-lens 512 --features 64 --layers 0 \
        --out /tmp/quick.json                                                # quick

The published code is never part of the library: each run imports it from the folder
an environment variable names (``KDEFORMER_OFFICIAL``: a checkout of
majid-daliri/kdeformer; ``FLY_OFFICIAL``: a checkout of HazyResearch/fly;
``REFORMER_PYTORCH``: a folder holding the ``reformer_pytorch`` package, unneeded when it
is installed; ``SKYFORMER_OFFICIAL``: a checkout of pkuzengqi/Skyformer) and calls it as
its own demos do. Both sides get the same Q/K/V:
pretrained MiniLM-L6 (``skyformer.eval.data.qkv``, the default text), all 12 heads, in
float64. Error: relative spectral norm of the output difference per head, against the
exact target of each comparison (softmax(s Q K^T) V; for Reformer, whose published code
only has shared-QK attention, softmax_{j != i}(s q_i . q_j / |q_j|) V), averaged over
heads; the table averages layers and seeds (± the sample std over seeds of the layer
mean). "mean(V)" is the trivial answer every row = the mean of V. Rows are saved (atomically) after
every (N, layer, m) and a rerun resumes, trusting the saved rows: after changing either
code use another ``--out``, or ``--fresh``, which drops the saved cells of its command
(a rerun without it then resumes where it stopped). The JSON records the settings, the
environment and the command of the latest run (its rows: every run's). The tables in
docs/approximation.md came from these calls.

Scatterbrain's published code calls fast-transformers' compiled local-product kernels,
which take float32 only; the comparison runs in float64 through a dense stand-in with
the same interface (``_DenseLocalProduct``, exact, slow: one head at a time), always.

Skyformer's release (``src/models`` of the checkout) is called as its LRA model calls
it: each attention module built from a config dict (its ``config.py`` entries with
``nb_features`` / ``num_landmarks`` / ``in_nb_features`` = m), then
``module(Q, K, V, mask)`` on ``[B, H, N, D]`` with an all-ones float mask. Nothing in
the checkout is patched: its ``Skyformer`` reads the device from ``config["device"]``
("cuda" when absent), which the script sets to "cpu"; its ``Attention`` wrapper (the
projections, and a cast to float32) is bypassed, so the modules run in float64. The
released Skyformer scales Q and K by a hard-coded ``32 ** -0.25``, the paper's
p^-1/4 for MiniLM-L6's head dim 32; at another head dim p it is given Q and K times
(32 / p)^(1/4) (``at_released_skyformer_scale``), which makes its scale p^-1/4 (it
reads Q and K only through that product). Targets: Skyformer's
rows (released and ours) against Gaussian kernelized attention C V, C_ij =
exp(-|q_i - k_j|^2 / (2 sqrt(p))), unnormalised; Nystromformer and Informer against
softmax(s Q K^T) V. Both are checked against the released code's own exact modules
(``SoftmaxAttention_RBF``, ``SoftmaxAttention``) on every layer. "one head a call"
calls a released module on each head alone, under the same seed: its inverse's
starting scale is a maximum over the whole [B, H] tensor, which one call of all heads
shares between heads.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import statistics
import sys
import types
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from run_metadata import run_metadata  # benchmarks/, beside this script

from skyformer.checks import positive_int_argument
from skyformer.eval.data.qkv import extract_qkv, load_model
from skyformer.eval.data.text import default_text
from skyformer.io import atomic_write_text, write_json
from skyformer.registry import get_method

RESULTS = Path(__file__).parent / "results" / "published"
SOURCES = {
    "kdeformer": ("KDEFORMER_OFFICIAL", "a checkout of github.com/majid-daliri/kdeformer"),
    "scatterbrain": ("FLY_OFFICIAL", "a checkout of github.com/HazyResearch/fly"),
    "reformer": ("REFORMER_PYTORCH",
                 "a folder holding the reformer_pytorch package (pip install --target DIR "
                 "--no-deps reformer-pytorch product-key-memory colt5-attention "
                 "axial-positional-embedding local-attention hyper-connections einops)"),
    "skyformer": ("SKYFORMER_OFFICIAL", "a checkout of github.com/pkuzengqi/Skyformer"),
}
Output = Callable[[int], torch.Tensor]  # seed -> output [1, H, N, D]


def published_path(method: str) -> str | None:
    """The folder to import the published ``method`` from, or a sentence why there is none."""
    var, what = SOURCES[method]
    path = os.environ.get(var)
    if path:
        if not Path(path).is_dir():
            sys.exit(f"{var}={path!r} is not a folder; set it to {what}.")
        return path
    if method == "reformer":
        if importlib.util.find_spec("reformer_pytorch") is None:
            sys.exit(f"reformer: set {var} to {what}, or install reformer-pytorch (the "
                     f"library never ships or imports it).")
        return None  # an installed reformer_pytorch is fine
    sys.exit(f"{method}: set {var} to {what} (the library never ships or imports it).")


def _importable_from(path: str | None) -> None:
    if path and path not in sys.path:
        sys.path.insert(0, path)


def relative_spectral(out: torch.Tensor, target: torch.Tensor) -> float:
    """Mean over heads of ||O - T||_2 / ||T||_2 (``[1, H, N, D]``)."""
    err = torch.linalg.matrix_norm(out - target, ord=2) / torch.linalg.matrix_norm(target, ord=2)
    return err.mean().item()


def softmax_target(q, k, v):
    return torch.softmax(q.shape[-1] ** -0.5 * q @ k.transpose(-1, -2), -1) @ v


def shared_qk_target(q, v):
    """softmax_{j != i}(s q_i . q_j / |q_j|) V: Reformer's shared-QK attention, self excluded."""
    logits = q.shape[-1] ** -0.5 * q @ F.normalize(q, dim=-1).transpose(-1, -2)
    eye = torch.eye(q.shape[2], dtype=torch.bool)
    return torch.softmax(logits.masked_fill(eye, float("-inf")), -1) @ v


def ours(name: str, q, k, v, **options) -> Output:
    attend = get_method(name).bind(seq_len=q.shape[2], **options)
    return lambda seed: attend(q, k, v, generator=torch.Generator().manual_seed(seed))


# -- KDEformer ---------------------------------------------------------------------------

def kdeformer_variants(q, k, v, m: int) -> dict[str, Output]:
    """Budget m/2 LSH-block keys + S sampled columns, S = m/2 and S = m (the demo's)."""
    _importable_from(published_path("kdeformer"))
    from KDEformer import KDEformer

    def published(s: int) -> Output:
        def run(seed: int) -> torch.Tensor:
            torch.manual_seed(seed)
            scale = q.shape[-1] ** -0.25  # the demo folds the softmax scale into Q and K
            module = KDEformer(num_projs=7, Bucket_size=m // 2, sample_size=s)
            # takes [B, N, H, D], returns [B, H, N, D]
            return module(*(t.transpose(1, 2) for t in (q * scale, k * scale, v)))
        return run

    out = {}
    for label, s in (("S=m/2", m // 2), ("S=m", m)):
        out[f"released, {label}"] = published(s)
        out[f"kdeformer, {label}"] = ours("kdeformer", q, k, v, num_features=s, block_size=m // 2)
        out[f"kdeformer strict, {label}"] = ours(
            "kdeformer", q, k, v, num_features=s - s // 8, kde_rows=max(1, s // 8),
            block_size=m // 2)
    return out


# -- Scatterbrain ------------------------------------------------------------------------

class _DenseLocalProduct(types.ModuleType):
    """fast_transformers.local_product without the compiled kernels: slot c of query l is
    key l - w//2 + c, valid inside [0, key length); invalid dot products are -1e24."""

    def __init__(self) -> None:
        super().__init__("fast_transformers.local_product")

    @staticmethod
    def _slots(length: int, width: int) -> torch.Tensor:
        return torch.arange(length)[:, None] - width // 2 + torch.arange(width)[None, :]

    def local_dot_product(self, queries, keys, attn_mask, key_lengths, local_context):
        n, _, length, _ = queries.shape
        slots = self._slots(length, local_context)
        clamped = slots.clamp(0, keys.shape[2] - 1)
        mask = attn_mask.to(queries.dtype)[torch.arange(length)[:, None], clamped]
        out = queries.new_full((*queries.shape[:3], local_context), -1e24)
        for b in range(n):
            valid = (slots >= 0) & (slots < min(int(key_lengths[b]), keys.shape[2]))
            dots = (queries[b] @ keys[b].transpose(-1, -2)).gather(
                -1, clamped.expand(queries.shape[1], -1, -1)) + mask
            out[b] = torch.where(valid, dots, out[b])
        return out

    def local_weighted_average(self, attention, values):
        length, width = attention.shape[2], attention.shape[3]
        slots = self._slots(length, width)
        valid = (slots >= 0) & (slots < values.shape[2])
        dense = attention.new_zeros(*attention.shape[:3], values.shape[2])
        dense.scatter_add_(-1, slots.clamp(0, values.shape[2] - 1).expand_as(attention),
                           torch.where(valid, attention, 0.0))
        return dense @ values


def _import_sblocal():
    _importable_from(published_path("scatterbrain"))
    # the compiled kernels are float32-only: the float64 comparison uses the stand-in
    package = types.ModuleType("fast_transformers")
    package.local_product = _DenseLocalProduct()  # type: ignore[attr-defined]
    sys.modules["fast_transformers"] = package
    sys.modules["fast_transformers.local_product"] = package.local_product
    from src.models.attention.sblocal_attention import SBLocalAttention
    return SBLocalAttention


def scatterbrain_variants(q, k, v, m: int) -> dict[str, Output]:
    """m feature columns and a window of m/2 keys on both sides."""
    sblocal = _import_sblocal()

    def published(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        module = sblocal(m // 2, q.shape[-1], m).double()
        heads = []
        for h in range(q.shape[1]):  # one head per call ([1, N, 1, D] layout)
            o, _ = module(*(t[:, h:h + 1].transpose(1, 2) for t in (q, k, v)))
            heads.append(o.transpose(1, 2))
        return torch.cat(heads, 1)

    return {
        "published SBLocal": published,
        "scatterbrain": ours("scatterbrain", q, k, v, num_features=m, support="local"),
        "scatterbrain, support=lsh": ours("scatterbrain", q, k, v, num_features=m, support="lsh"),
    }


# -- Reformer ----------------------------------------------------------------------------

def reformer_variants(q, k, v, m: int) -> dict[str, Output]:
    """Shared QK, 2 rounds, m keys per query and round (published: bucket_size = m/2)."""
    _importable_from(published_path("reformer"))
    from reformer_pytorch.reformer_pytorch import LSHAttention

    b, h, n, d = q.shape

    def published(duplicates: bool) -> Output:
        def run(seed: int) -> torch.Tensor:
            torch.manual_seed(seed)
            module = LSHAttention(bucket_size=m // 2, n_hashes=2, random_rotations_per_head=True,
                                  allow_duplicate_attention=duplicates)
            out, _, _ = module(q.reshape(b * h, n, d), v.reshape(b * h, n, d))
            return out.reshape(b, h, n, d)
        return run

    return {
        "published": published(True),
        "published, allow_duplicate_attention=False": published(False),
        "reformer": ours("reformer", q, q, v, num_features=m, shared_qk=True),
        "reformer, published bucket count": ours(
            "reformer", q, q, v, num_features=m, shared_qk=True, num_buckets=2 * n // m),
    }


# -- Skyformer's released code: Skyformer, Nystromformer, Informer -----------------------

def gaussian_target(q, k, v):
    """C V, C_ij = exp(-|q_i - k_j|^2 / (2 sqrt(p))): Gaussian kernelized attention,
    unnormalised (Skyformer eq. (3); the released ``SoftmaxAttention_RBF``)."""
    s = q.shape[-1] ** -0.5
    return torch.exp(-0.5 * s * torch.cdist(q, k).square()) @ v


def uses_gaussian_target(variant: str) -> bool:
    """Skyformer's rows approximate C V; every other row softmax(s Q K^T) V."""
    return variant.lower().startswith(("released skyformer", "skyformer"))


def _import_skyformer_official() -> types.SimpleNamespace:
    """The released attention modules, from ``src/models`` of the checkout."""
    checkout = published_path("skyformer")
    src = str(Path(checkout) / "src")
    if not (Path(src) / "models" / "attention_skyformer.py").is_file():
        var, what = SOURCES["skyformer"]
        sys.exit(f"{var}={checkout!r} holds no src/models/attention_skyformer.py; set it to "
                 f"{what}.")
    for name in ("models", "config"):  # the checkout's top-level names
        module = sys.modules.get(name)
        where = getattr(module, "__file__", None) or "".join(getattr(module, "__path__", []))
        if module is not None and not where.startswith(src):
            sys.exit(f"skyformer: a module named {name!r} is already imported from {where}; "
                     f"the released code needs its own (run the script in a fresh process).")
    _importable_from(src)
    from models.attention import SoftmaxAttention, SoftmaxAttention_RBF
    from models.attention_informer import ProbAttention
    from models.attention_nystrom import NystromAttention
    from models.attention_skyformer import Skyformer
    return types.SimpleNamespace(
        softmax=SoftmaxAttention, kernelized=SoftmaxAttention_RBF, skyformer=Skyformer,
        nystrom=NystromAttention, informer=ProbAttention)


def check_released_targets(q, k, v) -> None:
    """The released code's own exact attentions (``SoftmaxAttention``,
    ``SoftmaxAttention_RBF``) are this script's targets, or the run stops."""
    released = _import_skyformer_official()
    config = {"head_dim": q.shape[-1], "attention_dropout": 0.0}
    mask = q.new_ones(q.shape[0], q.shape[2])
    for name, ours_target in (("softmax", softmax_target), ("kernelized", gaussian_target)):
        module = getattr(released, name)(config).eval()
        got, want = module(q, k, v, mask), ours_target(q, k, v)
        err = relative_spectral(got, want)
        if not err < 1e-10:
            sys.exit(f"skyformer: the released {type(module).__name__} is {err:.2e} from this "
                     f"script's {name} target; the comparison would measure the targets.")


# the head dim the released Skyformer's scale is written for: it multiplies Q and K by
# RELEASED_HEAD_DIM ** -0.25 (``data_normalizer``) whatever the input's head dim
RELEASED_HEAD_DIM = 32


def at_released_skyformer_scale(q: torch.Tensor, k: torch.Tensor):
    """``q, k: [B, H, N, p]`` times ``(RELEASED_HEAD_DIM / p) ** 0.25``: the released
    Skyformer reads Q and K only through its fixed ``RELEASED_HEAD_DIM ** -0.25``, so on
    these inputs it runs at the paper's scale ``p ** -0.25`` of the input's head dim p."""
    factor = (RELEASED_HEAD_DIM / q.shape[-1]) ** 0.25
    return q * factor, k * factor


def _per_head(module, q, k, v, seed: int) -> torch.Tensor:
    """One head a call, each under ``torch.manual_seed(seed)`` (the same landmarks as one
    call of all heads), so that nothing is shared between heads."""
    mask = q.new_ones(q.shape[0], q.shape[2])
    heads = []
    for h in range(q.shape[1]):
        torch.manual_seed(seed)
        heads.append(module(q[:, h:h + 1], k[:, h:h + 1], v[:, h:h + 1], mask))
    return torch.cat(heads, 1)


def skyformer_variants(q, k, v, m: int) -> dict[str, Output]:
    """Skyformer (m landmarks, half from Q and half from K, 6 iterations, gamma = 0.1),
    Nystromformer (m segment means) and Informer (u = c ceil(ln N) active queries,
    c = ceil(m / ln N), the released code's ``in_nb_features`` = m)."""
    released = _import_skyformer_official()
    _, h, n, d = q.shape
    mask = q.new_ones(1, n)
    sky = released.skyformer({  # the LRA "skyformer" entry of its config.py
        "device": "cpu", "max_seq_len": n, "nb_features": m, "head_dim": d,
        "sketched_kernel": "kernel_RS_RBF", "accumulation": 1, "sampling_factor": 4,
        "no_projection": False}).eval()
    nystrom = {heads: released.nystrom({"head_dim": d, "num_head": heads, "num_landmarks": m,
                                        "max_seq_len": n}).eval() for heads in (h, 1)}
    informer = released.informer({"in_nb_features": m, "max_seq_len": n,
                                  "attention_dropout": 0.0}).eval()

    def together(module, q=q, k=k) -> Output:
        def run(seed: int) -> torch.Tensor:
            torch.manual_seed(seed)
            return module(q, k, v, mask)
        return run

    sky_q, sky_k = at_released_skyformer_scale(q, k)
    return {
        "released Skyformer": together(sky, sky_q, sky_k),
        "released Skyformer, one head a call":
            lambda seed: _per_head(sky, sky_q, sky_k, v, seed),
        "skyformer": ours("skyformer", q, k, v, num_features=m),
        "skyformer, pinv_init=scaled_transpose": ours(
            "skyformer", q, k, v, num_features=m, pinv_init="scaled_transpose"),
        "released Nystromformer": together(nystrom[h]),
        "released Nystromformer, one head a call":
            lambda seed: _per_head(nystrom[1], q, k, v, seed),
        "nystromformer": ours("nystromformer", q, k, v, num_features=m),
        "released Informer": together(informer),
        "informer": ours("informer", q, k, v, factor=informer.factor),
    }


TARGET_NOTES = {"skyformer": "\nSkyformer's rows (released and ours) against Gaussian "
                "kernelized attention C V, C_ij = exp(-|q_i - k_j|^2 / (2 sqrt(p))); the other "
                "rows and mean(V) against softmax(s Q K^T) V.\n"}
VARIANTS = {"kdeformer": kdeformer_variants, "scatterbrain": scatterbrain_variants,
            "reformer": reformer_variants, "skyformer": skyformer_variants}


def cell(n: int, layer: int, m: int, variant: str, seed: int, err: float) -> dict:
    return {"N": n, "layer": layer, "m": m, "variant": variant, "seed": seed, "err": err}


def table(rows: list[dict]) -> str:
    """Markdown: per N, a row per variant, m in columns; mean over layers and seeds ± the
    sample std over seeds of the layer mean. A NaN error (saved as null) shows as nan."""
    rows = [{**r, "err": math.nan if r["err"] is None else r["err"]} for r in rows]
    cells: dict[tuple, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        cells[(r["N"], r["variant"], r["m"], r["seed"])][r["layer"]].append(r["err"])
    lines = []
    for n in sorted({r["N"] for r in rows}):
        ms = sorted({r["m"] for r in rows if r["N"] == n and r["m"]})
        trivial = [r["err"] for r in rows if r["N"] == n and r["variant"] == "mean(V)"]
        lines += [f"\nN = {n} (mean(V) = {statistics.mean(trivial):.3f})\n",
                  "| variant | " + " | ".join(f"m={m}" for m in ms) + " |",
                  "|---|" + "---|" * len(ms)]
        variants = dict.fromkeys(r["variant"] for r in rows if r["N"] == n and r["m"])
        for name in variants:
            row = []
            for m in ms:
                seeds = [statistics.mean(e for errs in cells[(n, name, m, s)].values()
                                         for e in errs)
                         for s in sorted({r["seed"] for r in rows})
                         if cells.get((n, name, m, s))]
                spread = statistics.stdev(seeds) if len(seeds) > 1 else 0.0
                row.append(f"{statistics.mean(seeds):.3f} ± {spread:.3f}" if seeds else "")
            lines.append(f"| {name} | " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def _in_command(row: dict, args: argparse.Namespace) -> bool:
    """Whether ``row`` is a cell of the command ``args`` (its lengths, layers, sizes and
    seeds; the trivial row: one per length and layer, at seed 0)."""
    return row["N"] in args.seq_lens and row["layer"] in args.layers \
        and ((row["m"] in args.features and row["seed"] in args.seeds) or row["m"] == 0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("method", choices=sorted(VARIANTS))
    parser.add_argument("--seq-lens", type=positive_int_argument,
                        nargs="+", default=[512, 2048, 4096])
    parser.add_argument("--features", type=positive_int_argument,
                        nargs="+", default=[32, 64, 128, 256])
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 2, 4])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--threads", type=positive_int_argument, default=None)
    parser.add_argument("--out", type=Path, default=None,
                        help="JSON of every cell (default results/published/METHOD.json)")
    parser.add_argument("--fresh", action="store_true", help="drop the saved cells of this "
                        "command's lengths, layers, sizes and seeds and measure them again "
                        "(the JSON keeps the others; a rerun without --fresh resumes an "
                        "interrupted one; the table shows this command's)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    out = args.out or RESULTS / f"{args.method}.json"
    saved = json.loads(out.read_text())["rows"] if out.exists() else []
    metadata = run_metadata(__file__, argv, vars(args) | {"out": out})
    if args.fresh:  # this command's cells, of any variant (one renamed since too), go,
        kept = [r for r in saved if not _in_command(r, args)]
        if len(kept) < len(saved):  # from the file too: a run stopped before its first
            saved = kept  # save must not leave them to a rerun as done
            write_json(out, {"method": args.method, **metadata, "rows": saved})
    cells = {(r["N"], r["layer"], r["m"], r["variant"], r["seed"]): r for r in saved}
    done = set(cells)  # after --fresh, those of this run: an interrupted one resumes
    model, tokenizer, name = load_model(None, pretrained=True, seed=0)
    for n in args.seq_lens:
        for layer in args.layers:
            qkv = extract_qkv(model, tokenizer, default_text(), seq_len=n, layer=layer, name=name)
            q, k, v = (t.double() for t in (qkv.q, qkv.k, qkv.v))
            target = shared_qk_target(q, v) if args.method == "reformer" \
                else softmax_target(q, k, v)
            if args.method == "skyformer":
                check_released_targets(q, k, v)
                gaussian = gaussian_target(q, k, v)
            if (n, layer, 0, "mean(V)", 0) not in done:
                trivial = v.mean(2, keepdim=True).expand_as(target)
                cells[(n, layer, 0, "mean(V)", 0)] = cell(n, layer, 0, "mean(V)", 0,
                                                          relative_spectral(trivial, target))
            for m in args.features:
                for variant, run in VARIANTS[args.method](q, k, v, m).items():
                    for seed in args.seeds:
                        if (n, layer, m, variant, seed) in done:
                            continue
                        exact = gaussian if args.method == "skyformer" \
                            and uses_gaussian_target(variant) else target
                        with torch.no_grad():
                            err = relative_spectral(run(seed), exact)
                        cells[(n, layer, m, variant, seed)] = cell(n, layer, m, variant,
                                                                   seed, err)
                write_json(out, {"method": args.method, **metadata,
                                 "rows": list(cells.values())})
                print(f"N={n} layer={layer} m={m} done", flush=True)
    # the table of this command's cells alone; the JSON keeps every cell measured (a
    # later run with other lengths, layers, sizes or seeds reuses them)
    report = table([r for r in cells.values() if _in_command(r, args)])
    atomic_write_text(out.with_suffix(".md"), f"# {args.method} against its published code\n"
                      + TARGET_NOTES.get(args.method, "") + report)
    print(report)


if __name__ == "__main__":
    main()
