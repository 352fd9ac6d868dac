//! Products with float (not quantized) matrices in which every output row
//! depends only on its input row: the same sum, in the same order, whether
//! one row runs or five hundred.
//!
//! ```text
//!  x: rows × k      w: n × k (one row per output)
//!  tasks: blocks of COLUMNS columns of w ─► for each row of x, for each
//!         column of the block: dot(x row, w column) (8 lanes, fixed order)
//!      ─► y: rows × n
//! ```
//!
//! candle's own product of two float tensors takes other paths for one row
//! (a matrix-vector kernel) and for many (blocked), which round
//! differently. A router, a shared expert's gate, latent attention's
//! per-head maps or a float output head that rounded with the number of
//! rows beside it would let the prefix cache, chunked prefill or batching
//! change what a row computes (see `attention.rs` for the same rule in
//! attention), so they go through here. Quantized matrices keep the rule
//! in candle (their rows are quantized and dotted one by one), but for one
//! kernel [`quantized`] steers around. A float
//! model's large layer matrices keep candle's blocked product: this plain
//! one is as fast for up to about 8 rows but 3–4× slower for 128 (a
//! prompt's slice).

use candle_core::quantized::{GgmlDType, QMatMul};
use candle_core::{DType, Module, Storage, Tensor};

use super::kv::dot;
use crate::error::Result;

/// Columns of `w` one task takes: their weights stay in the core's cache
/// while every row passes.
const COLUMNS: usize = 16;

/// `x · wᵀ` for `x` of `rows × k` and `w` of `n × k`: `rows × n`.
pub(super) fn times_transposed(x: &[f32], w: &[f32], k: usize) -> Vec<f32> {
    debug_assert!(x.len().is_multiple_of(k.max(1)) && w.len().is_multiple_of(k.max(1)));
    if k == 0 {
        return Vec::new();
    }
    let (rows, n) = (x.len() / k, w.len() / k);
    let columns: Vec<&[f32]> = w.chunks(COLUMNS * k).collect();
    let blocks: Vec<Vec<f32>> = super::pool::run(columns.len(), |b| {
        let columns = columns[b];
        let mut out = Vec::with_capacity(rows * columns.len() / k);
        for row in x.chunks_exact(k) {
            out.extend(columns.chunks_exact(k).map(|column| dot(row, column)));
        }
        out
    });
    let mut y = vec![0f32; rows * n];
    for (b, block) in blocks.iter().enumerate() {
        let width = block.len() / rows.max(1);
        for (r, values) in block.chunks_exact(width.max(1)).enumerate() {
            let at = r * n + b * COLUMNS;
            y[at..at + width].copy_from_slice(values);
        }
    }
    y
}

/// `matrix`'s product with `x` (`rows × k`, or any shape whose last
/// dimension is `k`): row-invariant for a float matrix on the CPU and for a
/// quantized one (see [`quantized`]); candle's own on another device.
pub(super) fn forward(matrix: &QMatMul, x: &Tensor) -> Result<Tensor> {
    let QMatMul::Tensor(w) = matrix else {
        return quantized(matrix, x);
    };
    if !w.device().is_cpu() || w.rank() != 2 {
        return Ok(matrix.forward(x)?);
    }
    let (n, k) = w.dims2()?;
    let xs = host(x)?;
    let y = on_host(w, |weights| Ok(times_transposed(&xs, weights, k)))?;
    Ok(Tensor::from_vec(y, outputs_shape(x, n), x.device())?)
}

/// The shape of a product's result: `x`'s, its last dimension `n`.
fn outputs_shape(x: &Tensor, n: usize) -> Vec<usize> {
    let mut dims = x.dims().to_vec();
    *dims.last_mut().expect("an input has dimensions") = n;
    dims
}

/// candle's product of a quantized `matrix` with the rows `x` (`rows × k`),
/// row-invariant: candle dots each row by itself, but on x86 takes a
/// Q6_K matrix's single row through a compact kernel that sums in another
/// order than the tiles it uses for two rows and more (where the matrix's
/// shape allows tiles: `k` a multiple of 256, `n` of 16), so there a lone
/// row runs as two (itself twice; the second result is dropped). That
/// costs a large Q6_K matrix (a Q4_K_M file's output head) up to twice its
/// one-row time and a small one nothing (the tiles are faster there).
pub(super) fn quantized(matrix: &QMatMul, x: &Tensor) -> Result<Tensor> {
    let tiled_q6k = match matrix {
        QMatMul::QTensor(t) if cfg!(target_arch = "x86_64") && t.dtype() == GgmlDType::Q6K => {
            let (n, k) = t.shape().dims2()?;
            k.is_multiple_of(256) && n.is_multiple_of(16)
        }
        _ => false,
    };
    let k = x.dims().last().copied().unwrap_or(0);
    if !tiled_q6k || k == 0 || x.elem_count() != k {
        return Ok(matrix.forward(x)?);
    }
    let row = x.reshape((1, k))?;
    let y = matrix
        .forward(&Tensor::cat(&[&row, &row], 0)?)?
        .narrow(0, 0, 1)?;
    let n = y.dim(1)?;
    Ok(y.reshape(outputs_shape(x, n))?)
}

/// `f` of `t`'s values as one f32 slice: borrowed where `t` is a
/// contiguous f32 CPU tensor (a weight, every step), else copied.
fn on_host<T>(t: &Tensor, f: impl FnOnce(&[f32]) -> Result<T>) -> Result<T> {
    if t.dtype() == DType::F32 && t.is_contiguous() {
        let (storage, layout) = t.storage_and_layout();
        if let Storage::Cpu(cpu) = &*storage {
            let start = layout.start_offset();
            return f(&cpu.as_slice::<f32>()?[start..start + t.elem_count()]);
        }
    }
    f(&host(t)?)
}

/// A copy of a tensor's values on the host, as f32 (see [`on_host`] to
/// borrow them instead).
fn host(t: &Tensor) -> Result<Vec<f32>> {
    Ok(t.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?)
}

/// Per-head products: `x` is `[heads, rows, k]`, `w` `[heads, n, k]` (each
/// head's matrix, one row per output); returns `[heads, rows, n]`, each
/// row as it would be alone.
pub(super) fn per_head(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    let (heads, rows, k) = x.dims3()?;
    let (_, n, _) = w.dims3()?;
    let xs = host(x)?;
    let y = on_host(w, |ws| {
        let mut y = Vec::with_capacity(heads * rows * n);
        for h in 0..heads {
            y.extend(times_transposed(
                &xs[h * rows * k..(h + 1) * rows * k],
                &ws[h * n * k..(h + 1) * n * k],
                k,
            ));
        }
        Ok(y)
    })?;
    Ok(Tensor::from_vec(y, (heads, rows, n), x.device())?)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, seed: u32) -> Vec<f32> {
        (0..n)
            .map(|i| (((i as u32).wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    }

    #[test]
    fn the_product_is_right_and_a_row_is_the_same_alone_or_among_many() {
        // 37 outputs (not a whole number of column blocks), k = 70.
        let (n, k) = (37, 70);
        let w = values(n * k, 1);
        let x = values(100 * k, 2);
        let y = times_transposed(&x, &w, k);
        for r in [0, 41, 99] {
            for c in [0, 15, 16, 36] {
                let want: f64 = (0..k)
                    .map(|i| f64::from(x[r * k + i]) * f64::from(w[c * k + i]))
                    .sum();
                assert!((f64::from(y[r * n + c]) - want).abs() < 1e-4, "({r}, {c})");
            }
        }
        let alone = times_transposed(&x[41 * k..42 * k], &w, k);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&alone), bits(&y[41 * n..42 * n]));
        assert!(times_transposed(&[], &w, k).is_empty());
    }

    #[test]
    fn forward_keeps_the_shape_and_matches_candle_within_rounding() {
        let (n, k) = (20, 48);
        let w = Tensor::from_vec(values(n * k, 3), (n, k), &candle_core::Device::Cpu).unwrap();
        let x = Tensor::from_vec(values(3 * k, 4), (3, k), &candle_core::Device::Cpu).unwrap();
        let matrix = QMatMul::Tensor(w.clone());
        let ours = forward(&matrix, &x).unwrap();
        assert_eq!(ours.dims(), &[3, n]);
        let theirs = x.matmul(&w.t().unwrap()).unwrap();
        let gap = (ours - theirs)
            .unwrap()
            .abs()
            .unwrap()
            .flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(gap < 1e-4, "{gap}");
        // Per head: head 1 of two is its own product.
        let x2 = Tensor::stack(&[&x, &x.affine(0.5, 0.1).unwrap()], 0).unwrap();
        let w2 = Tensor::stack(&[&w, &w.affine(-1.0, 0.0).unwrap()], 0).unwrap();
        let y2 = per_head(&x2, &w2).unwrap();
        assert_eq!(y2.dims(), &[2, 3, n]);
        let want = forward(&QMatMul::Tensor(w2.get(1).unwrap()), &x2.get(1).unwrap()).unwrap();
        assert_eq!(
            y2.get(1)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap(),
            want.flatten_all().unwrap().to_vec1::<f32>().unwrap()
        );
    }

    /// Checked where candle's kernels were read: x86 without AMX (which
    /// takes Q4_K through other kernels from 32 rows on). candle's ARM
    /// kernels take rows by fours and the rest one by one, which this test
    /// would show.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn every_quantized_type_gives_a_row_the_same_bits_alone_or_among_many() {
        use candle_core::quantized::QTensor;
        let (n, k) = (64, 512);
        let cpu = &candle_core::Device::Cpu;
        let w = Tensor::from_vec(values(n * k, 3), (n, k), cpu).unwrap();
        let x = Tensor::from_vec(values(40 * k, 4), (40, k), cpu).unwrap();
        for dtype in [
            GgmlDType::Q4_0,
            GgmlDType::Q4_1,
            GgmlDType::Q5_0,
            GgmlDType::Q5_1,
            GgmlDType::Q8_0,
            GgmlDType::Q2K,
            GgmlDType::Q3K,
            GgmlDType::Q4K,
            GgmlDType::Q5K,
            GgmlDType::Q6K,
        ] {
            let m = QMatMul::from_qtensor(QTensor::quantize(&w, dtype).unwrap()).unwrap();
            let bits = |rows: usize| -> Vec<Vec<u32>> {
                forward(&m, &x.narrow(0, 0, rows).unwrap())
                    .unwrap()
                    .to_vec2::<f32>()
                    .unwrap()
                    .iter()
                    .map(|r| r.iter().map(|v| v.to_bits()).collect())
                    .collect()
            };
            let all = bits(40);
            for rows in [1, 2, 3, 5, 8, 33] {
                assert_eq!(bits(rows)[..], all[..rows], "{dtype:?}, {rows} rows");
            }
        }
    }
}
