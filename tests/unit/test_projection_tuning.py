"""Start-up's choice of the small-M kernel for a projection, and of the GEMM for an FP8 one, from
the times it measured (the timing itself runs on CUDA only: the GPU tests' start-ups)."""

from __future__ import annotations

import torch

from hf_paged.modeling.embedding import ParallelLMHead
from hf_paged.modeling.linear import _ParallelLinear
from hf_paged.worker import projection_tuning
from hf_paged.worker.fp8_tuning import fp8_mma_choice, gemm_rows, w8a8_rows
from hf_paged.worker.projection_tuning import (
    cached_report,
    group_name,
    set_choice,
    small_m_rows,
    time_small_m,
    tune_projections,
)


def test_the_kernel_serves_up_to_the_rows_where_it_won_clearly_at_every_count():
    cublas = {1: 12.6, 2: 8.1, 4: 12.7, 8: 5.9}
    assert small_m_rows(cublas, {1: 5.9, 2: 5.6, 4: 5.6, 8: 5.6}) == 4  # 5.6 > 0.9 * 5.9
    assert small_m_rows(cublas, {1: 5.9, 2: 7.5, 4: 5.6, 8: 5.0}) == 1  # lost at 2 rows
    assert small_m_rows(cublas, {1: 12.0, 2: 5.0, 4: 5.0, 8: 5.0}) == 0  # no clear win at 1
    assert small_m_rows(cublas, {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}) == 8
    assert small_m_rows(cublas, {1: 1.0, 2: 9.0}) == 1  # not measured past its first loss


def test_fp8_small_m_rows_take_any_win():  # FP8: against the project's own GEMM, no margin
    gemm = {1: 43.5, 2: 43.0}
    assert small_m_rows(gemm, {1: 39.8, 2: 44.0}) == 0
    assert small_m_rows(gemm, {1: 39.8, 2: 44.0}, margin=1.0) == 1
    assert small_m_rows(gemm, {1: 43.5}, margin=1.0) == 0  # a tie is no win


def _timed(monkeypatch, table: dict[str, dict[int, float]], normed: bool, margin: float = 0.9
           ) -> tuple[dict, list]:
    """``time_small_m`` over kernels whose microseconds ``table`` gives by name and rows; the
    (name, rows) pairs it timed."""
    timed = []

    def micros(kernel, x, weights):
        timed.append((kernel, x))
        return table[kernel][x]

    monkeypatch.setattr(projection_tuning, "_micros", micros)
    names = ["other", "small_m"] + ["small_m_apart"] * normed
    return time_small_m(lambda rows: (rows, dict(zip(names, names))), [None], margin), timed


def test_a_normed_group_takes_the_faster_small_m_variant_at_one_row(monkeypatch):
    table = {"other": {1: 45.0, 2: 45.0, 4: 45.0}, "small_m": {1: 46.1, 2: 80.0},
             "small_m_apart": {1: 42.0, 2: 44.0, 4: 70.0}}
    choice, timed = _timed(monkeypatch, table, normed=True, margin=1.0)
    assert choice["norm_apart"] and choice["small_m_rows"] == 2
    assert choice["small_m_us"] == {1: 42.0, 2: 44.0, 4: 70.0}
    assert (choice["small_m_fused_us"], choice["small_m_apart_us"]) == (46.1, 42.0)
    assert ("small_m", 2) not in timed  # the slower variant is timed at one row only
    table["small_m"][1] = 41.0  # fused faster: it serves
    choice, _ = _timed(monkeypatch, table, normed=True, margin=1.0)
    assert not choice["norm_apart"] and choice["small_m_rows"] == 1
    choice, _ = _timed(monkeypatch, table, normed=False)  # 41 > 0.9 * 45: no clear win
    assert "small_m_fused_us" not in choice and choice["small_m_rows"] == 0
    assert not choice["norm_apart"]


def test_the_choice_lands_on_the_modules_that_fuse_a_norm():
    class Projection:
        fuses_norm, norm_apart, small_m_rows = True, False, 0

    normed, plain = Projection(), Projection()
    plain.fuses_norm = False
    set_choice([normed, plain], {"small_m_rows": 2, "norm_apart": True})
    assert (normed.small_m_rows, normed.norm_apart, plain.small_m_rows) == (2, True, 2)
    assert not plain.norm_apart
    set_choice([normed], None)  # nothing measured: cuBLAS, the norm fused where it would run
    assert (normed.small_m_rows, normed.norm_apart) == (0, False)


def _groups(path: str) -> dict[str, set[str]]:
    """The timing group of every projection and LM head of ``path``'s model, by module name
    (the layer index left out)."""
    import hf_paged

    with hf_paged.from_pretrained(path, device="cpu") as engine:
        names: dict[str, set[str]] = {}
        for full, module in engine.model.hf_model.named_modules():
            if isinstance(module, (_ParallelLinear, ParallelLMHead)):
                key = ".".join(p for p in full.split(".") if not p.isdigit())
                names.setdefault(key, set()).add(group_name(module))
        return names


def test_timing_groups_name_what_the_model_runs(checkpoints, hybrid_checkpoints):
    """Qwen3's qkv and gate/up are timed with the RMSNorm the small-M kernel fuses into them,
    the LM head as itself; a hybrid family's zero-centred norms are not fused: no group of it
    is normed."""
    groups = _groups(checkpoints["gqa4_untied"])  # hidden 128, 8 + 2 + 2 heads of 32
    assert groups["model.layers.self_attn.qkv_proj"] == {"384x128 normed"}
    assert all(name.endswith(" gated normed") for name in groups["model.layers.mlp.gate_up_proj"])
    assert groups["model.layers.self_attn.o_proj"] == {"128x256"}
    assert all("normed" not in name for name in groups["model.layers.mlp.down_proj"])
    assert all(name.endswith(" lm_head") for name in groups["lm_head"])
    hybrid = _groups(hybrid_checkpoints["next_dense1"])
    assert not any("normed" in name for names in hybrid.values() for name in names)
    assert all(name.endswith(" lm_head") for name in hybrid["lm_head"])


def test_projections_off_cuda_keep_cublas(checkpoints):
    import hf_paged

    with hf_paged.from_pretrained(checkpoints["gqa_tied"], device="cpu",
                                  dtype=torch.bfloat16) as engine:
        assert tune_projections(engine.model.layers) == {}
        assert engine.startup_seconds.get("projections") is None


def test_cached_report_measures_once_per_key(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(tmp_path / "cache"))
    calls = []

    def measure():
        calls.append(1)
        return {"4096x1024": {"small_m_rows": len(calls)}}

    key = {"device": "GPU", "shapes": {"4096x1024": 28}}
    assert cached_report("projections", key, measure) == {"4096x1024": {"small_m_rows": 1}}
    assert cached_report("projections", key, measure) == {"4096x1024": {"small_m_rows": 1}}
    assert len(calls) == 1  # read back, not measured again
    assert cached_report("projections", {**key, "device": "other"}, measure) == {
        "4096x1024": {"small_m_rows": 2}}  # another key measures
    (tmp_path / "file").write_text("")  # a cache folder that cannot be made: not cached
    monkeypatch.setenv("HF_PAGED_CACHE_DIR", str(tmp_path / "file" / "cache"))
    assert cached_report("projections", key, measure) == {"4096x1024": {"small_m_rows": 3}}
    assert cached_report("projections", key, measure) == {"4096x1024": {"small_m_rows": 4}}


def test_w8a8_serves_from_the_fewest_rows_where_it_won_at_every_larger_count():
    dequant = {16: 10.0, 64: 12.0, 256: 30.0, 1024: 100.0, 4096: 400.0}
    assert w8a8_rows(dequant, {16: 12.0, 64: 13.0, 256: 25.0, 1024: 60.0, 4096: 220.0}) == 256
    assert w8a8_rows(dequant, {16: 9.0, 64: 13.0, 256: 25.0, 1024: 60.0, 4096: 220.0}) == 256
    assert w8a8_rows(dequant, {16: 9.0, 64: 11.0, 256: 25.0, 1024: 60.0, 4096: 220.0}) == 16
    assert w8a8_rows(dequant, {16: 9.0, 64: 11.0, 256: 25.0, 1024: 60.0, 4096: 401.0}) == 0


def test_cublas_serves_from_the_fewest_rows_where_it_beat_both_gemms_at_every_larger_count():
    dequant = {16: 10.0, 64: 12.0, 256: 30.0, 1024: 100.0, 4096: 400.0}
    w8a8 = {16: 12.0, 64: 11.0, 256: 25.0, 1024: 60.0, 4096: 220.0}
    # cuBLAS from 1,024 rows; below, w8a8 won at 64 and 256
    assert gemm_rows(dequant, w8a8, {16: 20, 64: 20, 256: 40, 1024: 50, 4096: 200}) == (64, 1024)
    # beaten by w8a8 at the most rows: never cuBLAS, w8a8 as alone
    assert gemm_rows(dequant, w8a8, {16: 5, 64: 5, 256: 5, 1024: 5, 4096: 230}) == (64, 0)
    # fastest everywhere: cuBLAS from the fewest rows measured, w8a8 never
    assert gemm_rows(dequant, w8a8, {r: 1.0 for r in dequant}) == (0, 16)


def test_the_fp8_tensor_core_gemm_is_the_faster_at_most_row_counts():
    triton = {16: 42.5, 64: 45.4, 256: 92.5, 1024: 369.8, 4096: 1459.0}
    assert fp8_mma_choice(triton, {}) == "w8a8_linear"  # torch's could not take the weight
    faster_large = {16: 50.0, 64: 50.0, 256: 60.0, 1024: 250.0, 4096: 900.0}
    assert fp8_mma_choice(triton, faster_large) == "scaled_mm_linear"
    faster_small = {16: 40.0, 64: 44.0, 256: 99.0, 1024: 400.0, 4096: 1500.0}
    assert fp8_mma_choice(triton, faster_small) == "w8a8_linear"


def test_torch_block_scaled_gemm_is_left_out_where_it_disagrees_or_fails(caplog):
    from hf_paged.worker.fp8_tuning import _scaled_mm_agrees

    weight = (torch.zeros(8, 32), None)
    w8a8 = lambda x, w: x[:, :8] * 2  # noqa: E731
    near = lambda x, w: x[:, :8] * 2 * (1 + 1e-4)  # noqa: E731

    def fails(x, w):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    assert _scaled_mm_agrees({"w8a8": w8a8, "scaled_mm": near}, weight, torch.float32)
    assert not _scaled_mm_agrees({"w8a8": w8a8, "scaled_mm": lambda x, w: x[:, :8]}, weight,
                                 torch.float32)
    assert not _scaled_mm_agrees({"w8a8": w8a8, "scaled_mm": fails}, weight, torch.float32)
    assert "differs" in caplog.text and "CUBLAS_STATUS_NOT_SUPPORTED" in caplog.text
