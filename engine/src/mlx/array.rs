//! A safe face on the shim: arrays that free themselves, operations that return
//! [`Error::Mlx`] instead of throwing, and maps of named arrays (model files).
#![allow(unsafe_code)]

use std::ffi::{CStr, CString, c_int};
use std::path::Path;
use std::ptr::NonNull;

use super::ffi;
use crate::error::{Error, Result};

/// The element types the backend uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    /// 32-bit float.
    F32 = 0,
    /// 16-bit float.
    F16 = 1,
    /// bfloat16.
    BF16 = 2,
    /// 32-bit unsigned integer (also packed quantized weights).
    U32 = 3,
    /// 32-bit signed integer.
    I32 = 4,
    /// Byte.
    U8 = 5,
}

impl Dtype {
    fn from_code(code: c_int) -> Option<Dtype> {
        Some(match code {
            0 => Dtype::F32,
            1 => Dtype::F16,
            2 => Dtype::BF16,
            3 => Dtype::U32,
            4 => Dtype::I32,
            5 => Dtype::U8,
            _ => return None,
        })
    }
}

/// The message the last failed call left on this thread.
fn last_error() -> String {
    // SAFETY: the shim returns a NUL-terminated string owned by a thread-local
    // that lives until the next failing call on this thread; it is copied here.
    unsafe { CStr::from_ptr(ffi::spx_last_error()) }
        .to_string_lossy()
        .into_owned()
}

pub(super) fn check(rc: c_int, what: &str) -> Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        Err(Error::Mlx(format!("{what}: {}", last_error())))
    }
}

fn c_path(path: &Path) -> Result<CString> {
    CString::new(path.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::InvalidInput(format!("path {} holds a NUL byte", path.display())))
}

pub(super) fn dims(shape: &[usize]) -> Result<Vec<c_int>> {
    shape
        .iter()
        .map(|&d| {
            c_int::try_from(d)
                .map_err(|_| Error::InvalidInput(format!("dimension {d} is too large")))
        })
        .collect()
}

/// The libmlx version the binary runs on, e.g. `0.32.4`.
pub fn version() -> String {
    // SAFETY: a plain integer from a function without arguments.
    let n = unsafe { ffi::spx_version() };
    format!("{}.{}.{}", n / 100_000, n / 1000 % 100, n % 1000)
}

/// Bytes MLX keeps in its buffer cache: freed by arrays that went, not
/// given back to the system, and reused for new ones.
pub fn cache_memory() -> usize {
    // SAFETY: a plain integer from a function without arguments.
    unsafe { ffi::spx_cache_memory() }
}

/// The BLAS the CPU matmuls run on (OpenBLAS's build string on Linux).
pub fn blas() -> String {
    // SAFETY: a static NUL-terminated string.
    unsafe { CStr::from_ptr(ffi::spx_blas()) }
        .to_string_lossy()
        .trim()
        .to_string()
}

/// An MLX array (a node of MLX's lazy graph until evaluated).
pub struct Array(NonNull<ffi::spx_array>);

// SAFETY: an array is a reference-counted handle (shared_ptr with atomic
// counts); the backend runs all MLX work under one lock (see `super::LOCK`),
// so a handle moved to another thread is never used by two at once.
unsafe impl Send for Array {}

impl Drop for Array {
    fn drop(&mut self) {
        // SAFETY: the handle came from the shim and is freed exactly once.
        unsafe { ffi::spx_array_free(self.0.as_ptr()) }
    }
}

impl std::fmt::Debug for Array {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Array({:?}, {:?})", self.shape(), self.dtype())
    }
}

/// Runs a shim call that makes one array.
pub(super) fn make(what: &str, f: impl FnOnce(*mut ffi::array) -> c_int) -> Result<Array> {
    let mut out: ffi::array = std::ptr::null_mut();
    check(f(&mut out), what)?;
    NonNull::new(out)
        .map(Array)
        .ok_or_else(|| Error::Mlx(format!("{what}: no array returned")))
}

fn raw(a: Option<&Array>) -> *const ffi::spx_array {
    a.map_or(std::ptr::null(), |a| a.0.as_ptr())
}

impl Array {
    pub(super) fn ptr(&self) -> *const ffi::spx_array {
        self.0.as_ptr()
    }

    fn from_data<T: Copy>(data: &[T], shape: &[usize], dtype: Dtype) -> Result<Array> {
        let n: usize = shape.iter().product();
        if n != data.len() {
            return Err(Error::InvalidInput(format!(
                "{} values cannot fill shape {shape:?}",
                data.len()
            )));
        }
        let d = dims(shape)?;
        // SAFETY: `data` holds exactly the elements `shape` needs; the shim copies them.
        make("array", |out| unsafe {
            ffi::spx_array_from_data(
                data.as_ptr().cast(),
                dtype as c_int,
                d.as_ptr(),
                d.len() as c_int,
                out,
            )
        })
    }

    /// A float array of `shape` holding `data` (row-major).
    pub fn from_f32(data: &[f32], shape: &[usize]) -> Result<Array> {
        Self::from_data(data, shape, Dtype::F32)
    }

    /// A 16-bit float array (`F16` or `BF16`) from the values' bits.
    pub fn from_halves(bits: &[u16], shape: &[usize], dtype: Dtype) -> Result<Array> {
        match dtype {
            Dtype::F16 | Dtype::BF16 => Self::from_data(bits, shape, dtype),
            other => Err(Error::InvalidInput(format!(
                "{other:?} is not a 16-bit float type"
            ))),
        }
    }

    /// A byte array (MXFP4 scales).
    pub fn from_bytes(data: &[u8], shape: &[usize]) -> Result<Array> {
        Self::from_data(data, shape, Dtype::U8)
    }

    /// An unsigned integer array (token ids, indices).
    pub fn from_u32(data: &[u32], shape: &[usize]) -> Result<Array> {
        Self::from_data(data, shape, Dtype::U32)
    }

    /// Zeros of `shape`.
    pub fn zeros(shape: &[usize], dtype: Dtype) -> Result<Array> {
        let d = dims(shape)?;
        // SAFETY: `d` outlives the call.
        make("zeros", |out| unsafe {
            ffi::spx_zeros(d.as_ptr(), d.len() as c_int, dtype as c_int, out)
        })
    }

    /// The dimensions.
    pub fn shape(&self) -> Vec<usize> {
        // SAFETY: the handle is live; `dims` has room for every dimension.
        unsafe {
            let n = ffi::spx_array_ndim(self.ptr()).max(0) as usize;
            let mut d = vec![0 as c_int; n];
            ffi::spx_array_shape(self.ptr(), d.as_mut_ptr());
            d.into_iter().map(|x| x as usize).collect()
        }
    }

    /// The element type (None for a type the backend does not use).
    pub fn dtype(&self) -> Option<Dtype> {
        // SAFETY: the handle is live.
        Dtype::from_code(unsafe { ffi::spx_array_dtype(self.ptr()) })
    }

    /// Bytes of the array's elements.
    pub fn nbytes(&self) -> usize {
        // SAFETY: the handle is live.
        unsafe { ffi::spx_array_nbytes(self.ptr()) }
    }

    /// Evaluates the array and reads it as f32 values (row-major).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let n: usize = self.shape().iter().product();
        let mut out = vec![0f32; n];
        // SAFETY: `out` has room for n f32 values; the shim checks the size.
        check(
            unsafe {
                ffi::spx_array_read(
                    self.0.as_ptr(),
                    Dtype::F32 as c_int,
                    out.as_mut_ptr().cast(),
                    n * std::mem::size_of::<f32>(),
                )
            },
            "read",
        )?;
        Ok(out)
    }

    /// Evaluates several arrays together.
    pub fn eval(arrays: &[&Array]) -> Result<()> {
        let ptrs: Vec<ffi::array> = arrays.iter().map(|a| a.0.as_ptr()).collect();
        // SAFETY: every handle is live for the call.
        check(unsafe { ffi::spx_eval(ptrs.as_ptr(), ptrs.len()) }, "eval")
    }

    /// Converts to `dtype`.
    pub fn astype(&self, dtype: Dtype) -> Result<Array> {
        // SAFETY: live handle in, new handle out.
        make("astype", |out| unsafe {
            ffi::spx_astype(self.ptr(), dtype as c_int, out)
        })
    }

    /// The same elements in `shape`.
    pub fn reshape(&self, shape: &[usize]) -> Result<Array> {
        let d = dims(shape)?;
        // SAFETY: live handle and `d` for the call.
        make("reshape", |out| unsafe {
            ffi::spx_reshape(self.ptr(), d.as_ptr(), d.len() as c_int, out)
        })
    }

    /// Permutes the axes.
    pub fn transpose(&self, axes: &[usize]) -> Result<Array> {
        let a = dims(axes)?;
        // SAFETY: live handle and `a` for the call.
        make("transpose", |out| unsafe {
            ffi::spx_transpose(self.ptr(), a.as_ptr(), a.len() as c_int, out)
        })
    }

    /// The block `start..stop` (one bound per axis).
    pub fn slice(&self, start: &[usize], stop: &[usize]) -> Result<Array> {
        let (a, b) = (dims(start)?, dims(stop)?);
        if a.len() != b.len() {
            return Err(Error::InvalidInput(
                "slice bounds of different ranks".into(),
            ));
        }
        // SAFETY: live handle and bounds for the call.
        make("slice", |out| unsafe {
            ffi::spx_slice(self.ptr(), a.as_ptr(), b.as_ptr(), a.len() as c_int, out)
        })
    }

    /// This array with the block `start..stop` replaced by `update`.
    pub fn slice_update(&self, update: &Array, start: &[usize], stop: &[usize]) -> Result<Array> {
        let (a, b) = (dims(start)?, dims(stop)?);
        if a.len() != b.len() {
            return Err(Error::InvalidInput(
                "slice bounds of different ranks".into(),
            ));
        }
        // SAFETY: live handles and bounds for the call.
        make("slice_update", |out| unsafe {
            ffi::spx_slice_update(
                self.ptr(),
                update.ptr(),
                a.as_ptr(),
                b.as_ptr(),
                a.len() as c_int,
                out,
            )
        })
    }

    /// Joins arrays along `axis`.
    pub fn concatenate(arrays: &[&Array], axis: usize) -> Result<Array> {
        let ptrs: Vec<ffi::array> = arrays.iter().map(|a| a.0.as_ptr()).collect();
        // SAFETY: live handles for the call.
        make("concatenate", |out| unsafe {
            ffi::spx_concatenate(ptrs.as_ptr(), ptrs.len(), axis as c_int, out)
        })
    }

    /// The slices at `indices` along `axis`.
    pub fn take(&self, indices: &Array, axis: usize) -> Result<Array> {
        // SAFETY: live handles for the call.
        make("take", |out| unsafe {
            ffi::spx_take(self.ptr(), indices.ptr(), axis as c_int, out)
        })
    }

    /// Element-wise sum (broadcasting).
    pub fn add(&self, other: &Array) -> Result<Array> {
        // SAFETY: live handles for the call.
        make("add", |out| unsafe {
            ffi::spx_add(self.ptr(), other.ptr(), out)
        })
    }

    /// Element-wise product (broadcasting).
    pub fn multiply(&self, other: &Array) -> Result<Array> {
        // SAFETY: live handles for the call.
        make("multiply", |out| unsafe {
            ffi::spx_multiply(self.ptr(), other.ptr(), out)
        })
    }

    /// `x * sigmoid(x)`.
    pub fn silu(&self) -> Result<Array> {
        // SAFETY: live handle for the call.
        make("silu", |out| unsafe { ffi::spx_silu(self.ptr(), out) })
    }

    /// `1 / (1 + e^-x)`.
    pub fn sigmoid(&self) -> Result<Array> {
        // SAFETY: live handle for the call.
        make("sigmoid", |out| unsafe {
            ffi::spx_sigmoid(self.ptr(), out)
        })
    }

    /// GELU, tanh approximation.
    pub fn gelu_tanh(&self) -> Result<Array> {
        // SAFETY: live handle for the call.
        make("gelu_tanh", |out| unsafe {
            ffi::spx_gelu_tanh(self.ptr(), out)
        })
    }

    /// gpt-oss's gated unit of this gate and `up`: the gate clamped above,
    /// the up projection both ways, `gate · sigmoid(alpha gate) · (up + 1)`.
    pub fn swiglu_oai(&self, up: &Array, alpha: f32, limit: f32) -> Result<Array> {
        // SAFETY: live handles for the call.
        make("swiglu_oai", |out| unsafe {
            ffi::spx_swiglu_oai(self.ptr(), up.ptr(), alpha, limit, out)
        })
    }

    /// Every element times `factor`.
    pub fn scale(&self, factor: f32) -> Result<Array> {
        self.multiply(&Array::from_f32(&[factor], &[1])?)
    }

    /// Matrix product.
    pub fn matmul(&self, other: &Array) -> Result<Array> {
        // SAFETY: live handles for the call.
        make("matmul", |out| unsafe {
            ffi::spx_matmul(self.ptr(), other.ptr(), out)
        })
    }
}

/// MLX's quantization modes the backend reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QuantMode {
    /// `scale · code + bias` per group (f32 scales and biases).
    Affine,
    /// 4-bit floats (E2M1) sharing a power-of-two byte scale (E8M0) per 32.
    Mxfp4,
}

impl QuantMode {
    fn name(self) -> &'static CStr {
        match self {
            QuantMode::Affine => c"affine",
            QuantMode::Mxfp4 => c"mxfp4",
        }
    }
}

/// How a matrix is quantized: per-group scales (and, affine, biases).
pub struct Quant {
    /// One per group: f32 (affine) or an E8M0 byte (MXFP4).
    pub scales: Array,
    /// One per group (affine only).
    pub biases: Option<Array>,
    /// Values per group.
    pub group_size: usize,
    /// Bits per value.
    pub bits: usize,
    /// What the codes and scales mean.
    pub mode: QuantMode,
    /// Groups of 16 held as groups of 32 whose second half is padding (GGUF's
    /// Q6_K, Q3_K and Q2_K, whose scales cover 16 values each, which MLX's
    /// products cannot group): the stored matrix is twice as wide as the
    /// one it stands for, and inputs are spread to match, 16 values then 16
    /// zeros, so the padding never counts.
    pub spread: bool,
}

impl Quant {
    /// Bytes of the scales and biases.
    pub fn bytes(&self) -> usize {
        self.scales.nbytes() + self.biases.as_ref().map_or(0, Array::nbytes)
    }
}

/// Values per group a spread matrix's scales cover.
pub const SPREAD_GROUP: usize = 16;

/// `x` (`[…, in]`) as a spread matrix takes it: every 16 values followed by
/// 16 zeros (`[…, 2 · in]`).
fn spread_inputs(x: &Array) -> Result<Array> {
    let shape = x.shape();
    let Some((&inp, lead)) = shape.split_last() else {
        return Err(Error::Mlx("spread inputs: a scalar".into()));
    };
    if !inp.is_multiple_of(SPREAD_GROUP) {
        return Err(Error::Mlx(format!(
            "spread inputs: {inp} values are not whole groups of {SPREAD_GROUP}"
        )));
    }
    let mut groups: Vec<usize> = lead.to_vec();
    groups.extend([inp / SPREAD_GROUP, SPREAD_GROUP]);
    let zeros = Array::zeros(&groups, x.dtype().unwrap_or(Dtype::F32))?;
    let padded = Array::concatenate(&[&x.reshape(&groups)?, &zeros], lead.len() + 1)?;
    let mut wide: Vec<usize> = lead.to_vec();
    wide.push(2 * inp);
    padded.reshape(&wide)
}

/// `x @ dequantize(w).T` without dequantizing.
pub fn quantized_matmul(x: &Array, w: &Array, q: &Quant) -> Result<Array> {
    let spread;
    let x = if q.spread {
        spread = spread_inputs(x)?;
        &spread
    } else {
        x
    };
    // SAFETY: live handles (or null for no biases) and a static string for the call.
    make("quantized_matmul", |out| unsafe {
        ffi::spx_quantized_matmul(
            x.ptr(),
            w.ptr(),
            q.scales.ptr(),
            raw(q.biases.as_ref()),
            1,
            q.group_size as c_int,
            q.bits as c_int,
            q.mode.name().as_ptr(),
            out,
        )
    })
}

/// The float matrix a quantized one stands for (a spread one without its
/// padding).
pub fn dequantize(w: &Array, q: &Quant) -> Result<Array> {
    let wide = dequantize_stored(w, q)?;
    if !q.spread {
        return Ok(wide);
    }
    debug_assert!(q.group_size == 2 * SPREAD_GROUP && q.mode == QuantMode::Affine);
    let shape = wide.shape();
    let Some((&width, lead)) = shape.split_last() else {
        return Err(Error::Mlx("dequantize: a scalar".into()));
    };
    let groups = width / (2 * SPREAD_GROUP);
    let mut grouped: Vec<usize> = lead.to_vec();
    grouped.extend([groups, 2 * SPREAD_GROUP]);
    let start = vec![0; grouped.len()];
    let mut stop = grouped.clone();
    *stop.last_mut().expect("two axes at least") = SPREAD_GROUP;
    let mut narrow: Vec<usize> = lead.to_vec();
    narrow.push(groups * SPREAD_GROUP);
    wide.reshape(&grouped)?
        .slice(&start, &stop)?
        .reshape(&narrow)
}

/// The float matrix as stored (a spread one with its padding).
fn dequantize_stored(w: &Array, q: &Quant) -> Result<Array> {
    // SAFETY: live handles (or null) and a static string for the call.
    make("dequantize", |out| unsafe {
        ffi::spx_dequantize(
            w.ptr(),
            q.scales.ptr(),
            raw(q.biases.as_ref()),
            q.group_size as c_int,
            q.bits as c_int,
            q.mode.name().as_ptr(),
            out,
        )
    })
}

/// A mixture of experts' routing of router logits `[tokens, experts]`: the
/// `k` experts each token chooses (`[tokens, k]` u32, in no particular
/// order) and their weights (the softmax over all experts, renormalised over
/// the chosen when `normalize`).
pub fn route(logits: &Array, k: usize, normalize: bool) -> Result<(Array, Array)> {
    let mut indices: ffi::array = std::ptr::null_mut();
    let mut scores: ffi::array = std::ptr::null_mut();
    // SAFETY: a live handle, and two out-pointers the shim fills on success.
    let rc = unsafe {
        ffi::spx_route(
            logits.ptr(),
            k as c_int,
            c_int::from(normalize),
            &mut indices,
            &mut scores,
        )
    };
    check(rc, "route")?;
    let take = |p: ffi::array| {
        NonNull::new(p)
            .map(Array)
            .ok_or_else(|| Error::Mlx("route: no array returned".into()))
    };
    Ok((take(indices)?, take(scores)?))
}

/// `x @ w[e]ᵀ` for each expert `e` of `indices`, `w` stacked and quantized
/// (`[experts, out, in × bits / 32]`, twice `in` when spread).
pub fn gather_quantized_matmul(x: &Array, w: &Array, q: &Quant, indices: &Array) -> Result<Array> {
    let spread;
    let x = if q.spread {
        spread = spread_inputs(x)?;
        &spread
    } else {
        x
    };
    // SAFETY: live handles (or null for no biases) and a static string for the call.
    make("gather_qmm", |out| unsafe {
        ffi::spx_gather_qmm(
            x.ptr(),
            w.ptr(),
            q.scales.ptr(),
            raw(q.biases.as_ref()),
            indices.ptr(),
            q.group_size as c_int,
            q.bits as c_int,
            q.mode.name().as_ptr(),
            out,
        )
    })
}

/// `x @ w[e]` for each expert `e` of `indices`, `w` stacked and dense
/// (`[experts, in, out]`).
pub fn gather_matmul(x: &Array, w: &Array, indices: &Array) -> Result<Array> {
    // SAFETY: live handles for the call.
    make("gather_mm", |out| unsafe {
        ffi::spx_gather_mm(x.ptr(), w.ptr(), indices.ptr(), out)
    })
}

/// RMS norm over the last axis (MLX's fused kernel).
pub fn rms_norm(x: &Array, weight: &Array, eps: f32) -> Result<Array> {
    // SAFETY: live handles for the call.
    make("rms_norm", |out| unsafe {
        ffi::spx_rms_norm(x.ptr(), weight.ptr(), eps, out)
    })
}

/// Rotary embedding of `x` (`[batch, heads, tokens, head_dim]`) for positions
/// `offset..`, each multiplied by `scale`; `traditional` rotates interleaved
/// pairs, else the two halves. The angle of pair `i` is the position over
/// `base^(2i/dims)`, or over `periods[i]` when given (YaRN's).
pub fn rope(
    x: &Array,
    dims: usize,
    traditional: bool,
    base: f32,
    scale: f32,
    offset: usize,
    periods: Option<&Array>,
) -> Result<Array> {
    let offset = c_int::try_from(offset)
        .map_err(|_| Error::InvalidInput(format!("position {offset} is too large")))?;
    // SAFETY: live handle for the call.
    make("rope", |out| unsafe {
        ffi::spx_rope(
            x.ptr(),
            dims as c_int,
            c_int::from(traditional),
            base,
            scale,
            offset,
            raw(periods),
            out,
        )
    })
}

/// How attention is masked.
#[derive(Debug, Clone, Copy)]
pub enum Mask<'a> {
    /// Every query sees every key.
    None,
    /// Query i sees keys up to its own position (queries are the last keys).
    Causal,
    /// An additive mask.
    Array(&'a Array),
}

/// Scaled dot-product attention (MLX's fused kernel; fewer KV heads than
/// query heads is grouped-query attention).
pub fn attention(
    q: &Array,
    k: &Array,
    v: &Array,
    scale: f32,
    mask: Mask<'_>,
    sinks: Option<&Array>,
) -> Result<Array> {
    let (mode, m) = match mask {
        Mask::None => (0, None),
        Mask::Causal => (1, None),
        Mask::Array(a) => (2, Some(a)),
    };
    // SAFETY: live handles (or null) for the call.
    make("scaled_dot_product_attention", |out| unsafe {
        ffi::spx_sdpa(
            q.ptr(),
            k.ptr(),
            v.ptr(),
            scale,
            mode,
            raw(m),
            raw(sinks),
            out,
        )
    })
}

/// Named arrays: what a model file holds.
pub struct TensorMap(NonNull<ffi::spx_map>);

// SAFETY: as for `Array`: handles only, used under the backend's lock.
unsafe impl Send for TensorMap {}

impl Drop for TensorMap {
    fn drop(&mut self) {
        // SAFETY: the map came from the shim and is freed exactly once.
        unsafe { ffi::spx_map_free(self.0.as_ptr()) }
    }
}

impl TensorMap {
    fn from_call(what: &str, f: impl FnOnce(*mut *mut ffi::spx_map) -> c_int) -> Result<Self> {
        let mut out = std::ptr::null_mut();
        check(f(&mut out), what)?;
        NonNull::new(out)
            .map(TensorMap)
            .ok_or_else(|| Error::Mlx(format!("{what}: no map returned")))
    }

    /// Every tensor of a GGUF file, read by MLX (Q4_0, Q4_1 and Q8_0 stay
    /// quantized as `name.weight` / `name.scales` / `name.biases`; other
    /// quantized types become f16; a file holding a type MLX lacks, such
    /// as MXFP4, gives nothing). `shardplane convert` reads with it; stages
    /// read through `gguf_read`.
    pub fn load_gguf(path: &Path) -> Result<Self> {
        let p = c_path(path)?;
        // SAFETY: `p` outlives the call.
        Self::from_call(&format!("load_gguf {}", path.display()), |out| unsafe {
            ffi::spx_load_gguf(p.as_ptr(), out)
        })
    }

    /// The tensors of a safetensors file (read lazily by MLX).
    pub fn load_safetensors(path: &Path) -> Result<Self> {
        let p = c_path(path)?;
        // SAFETY: `p` outlives the call.
        Self::from_call(
            &format!("load_safetensors {}", path.display()),
            |out| unsafe { ffi::spx_load_safetensors(p.as_ptr(), out) },
        )
    }

    /// An empty map.
    pub fn new() -> Self {
        // SAFETY: allocation only; never null (operator new throws instead,
        // which would abort: out of memory).
        TensorMap(NonNull::new(unsafe { ffi::spx_map_new() }).expect("spx_map_new"))
    }

    /// The names, in the map's order.
    pub fn names(&self) -> Vec<String> {
        // SAFETY: indices below the length; keys are NUL-terminated and copied.
        unsafe {
            (0..ffi::spx_map_len(self.0.as_ptr()))
                .map(|i| {
                    CStr::from_ptr(ffi::spx_map_key(self.0.as_ptr(), i))
                        .to_string_lossy()
                        .into_owned()
                })
                .collect()
        }
    }

    /// Whether `name` is in the map.
    pub fn contains(&self, name: &str) -> bool {
        match c_string(name) {
            // SAFETY: live map and `n` for the call.
            Ok(n) => unsafe { ffi::spx_map_contains(self.0.as_ptr(), n.as_ptr()) == 1 },
            Err(_) => false,
        }
    }

    /// The array named `name` (a new handle on the same data).
    pub fn get(&self, name: &str) -> Result<Array> {
        let n = c_string(name)?;
        // SAFETY: live map and `n` for the call.
        make(&format!("tensor {name}"), |out| unsafe {
            ffi::spx_map_get(self.0.as_ptr(), n.as_ptr(), out)
        })
    }

    /// Adds or replaces `name`.
    pub fn insert(&mut self, name: &str, a: &Array) -> Result<()> {
        let n = c_string(name)?;
        // SAFETY: live map, array and `n` for the call.
        check(
            unsafe { ffi::spx_map_insert(self.0.as_ptr(), n.as_ptr(), a.ptr()) },
            "insert",
        )
    }

    /// Writes the map as a safetensors file (metadata `format: mlx`).
    pub fn save_safetensors(&self, path: &Path) -> Result<()> {
        let p = c_path(path)?;
        // SAFETY: live map and `p` for the call.
        check(
            unsafe { ffi::spx_save_safetensors(p.as_ptr(), self.0.as_ptr()) },
            &format!("save_safetensors {}", path.display()),
        )
    }
}

impl Default for TensorMap {
    fn default() -> Self {
        Self::new()
    }
}

pub(super) fn c_string(s: &str) -> Result<CString> {
    CString::new(s).map_err(|_| Error::InvalidInput(format!("{s:?} holds a NUL byte")))
}
