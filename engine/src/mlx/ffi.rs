//! The C interface of `mlx/shim.cpp`. Every call that can fail returns
//! non-zero and leaves a message for [`spx_last_error`] on the calling thread.
#![allow(unsafe_code, missing_docs)]

use std::ffi::c_char;
use std::os::raw::{c_int, c_void};

#[repr(C)]
pub struct spx_array {
    _private: [u8; 0],
}
#[repr(C)]
pub struct spx_map {
    _private: [u8; 0],
}
#[repr(C)]
pub struct spx_group {
    _private: [u8; 0],
}

#[allow(non_camel_case_types)]
pub type array = *mut spx_array;

unsafe extern "C" {
    pub fn spx_last_error() -> *const c_char;
    pub fn spx_version() -> c_int;
    pub fn spx_cache_memory() -> usize;
    pub fn spx_blas() -> *const c_char;

    pub fn spx_array_free(a: array);
    pub fn spx_array_from_data(
        data: *const c_void,
        dtype: c_int,
        dims: *const c_int,
        ndim: c_int,
        out: *mut array,
    ) -> c_int;
    pub fn spx_array_ndim(a: *const spx_array) -> c_int;
    pub fn spx_array_shape(a: *const spx_array, dims: *mut c_int);
    pub fn spx_array_dtype(a: *const spx_array) -> c_int;
    pub fn spx_array_nbytes(a: *const spx_array) -> usize;
    pub fn spx_array_read(a: array, dtype: c_int, out: *mut c_void, nbytes: usize) -> c_int;
    pub fn spx_eval(arrays: *const array, n: usize) -> c_int;

    pub fn spx_astype(a: *const spx_array, dtype: c_int, out: *mut array) -> c_int;
    pub fn spx_zeros(dims: *const c_int, ndim: c_int, dtype: c_int, out: *mut array) -> c_int;
    pub fn spx_reshape(
        a: *const spx_array,
        dims: *const c_int,
        ndim: c_int,
        out: *mut array,
    ) -> c_int;
    pub fn spx_transpose(
        a: *const spx_array,
        axes: *const c_int,
        n: c_int,
        out: *mut array,
    ) -> c_int;
    pub fn spx_slice(
        a: *const spx_array,
        start: *const c_int,
        stop: *const c_int,
        n: c_int,
        out: *mut array,
    ) -> c_int;
    pub fn spx_slice_update(
        a: *const spx_array,
        update: *const spx_array,
        start: *const c_int,
        stop: *const c_int,
        n: c_int,
        out: *mut array,
    ) -> c_int;
    pub fn spx_concatenate(arrays: *const array, n: usize, axis: c_int, out: *mut array) -> c_int;
    pub fn spx_take(
        a: *const spx_array,
        indices: *const spx_array,
        axis: c_int,
        out: *mut array,
    ) -> c_int;
    pub fn spx_add(a: *const spx_array, b: *const spx_array, out: *mut array) -> c_int;
    pub fn spx_multiply(a: *const spx_array, b: *const spx_array, out: *mut array) -> c_int;
    pub fn spx_silu(a: *const spx_array, out: *mut array) -> c_int;
    pub fn spx_sigmoid(a: *const spx_array, out: *mut array) -> c_int;
    pub fn spx_gelu_tanh(a: *const spx_array, out: *mut array) -> c_int;
    pub fn spx_swiglu_oai(
        gate: *const spx_array,
        up: *const spx_array,
        alpha: f32,
        limit: f32,
        out: *mut array,
    ) -> c_int;
    pub fn spx_matmul(a: *const spx_array, b: *const spx_array, out: *mut array) -> c_int;
    pub fn spx_quantized_matmul(
        x: *const spx_array,
        w: *const spx_array,
        scales: *const spx_array,
        biases: *const spx_array,
        transpose: c_int,
        group_size: c_int,
        bits: c_int,
        mode: *const c_char,
        out: *mut array,
    ) -> c_int;
    pub fn spx_route(
        logits: *const spx_array,
        k: c_int,
        normalize: c_int,
        indices: *mut array,
        scores: *mut array,
    ) -> c_int;
    pub fn spx_gather_qmm(
        x: *const spx_array,
        w: *const spx_array,
        scales: *const spx_array,
        biases: *const spx_array,
        rhs_indices: *const spx_array,
        group_size: c_int,
        bits: c_int,
        mode: *const c_char,
        out: *mut array,
    ) -> c_int;
    pub fn spx_gather_mm(
        x: *const spx_array,
        w: *const spx_array,
        rhs_indices: *const spx_array,
        out: *mut array,
    ) -> c_int;
    pub fn spx_dequantize(
        w: *const spx_array,
        scales: *const spx_array,
        biases: *const spx_array,
        group_size: c_int,
        bits: c_int,
        mode: *const c_char,
        out: *mut array,
    ) -> c_int;
    pub fn spx_rms_norm(
        x: *const spx_array,
        weight: *const spx_array,
        eps: f32,
        out: *mut array,
    ) -> c_int;
    pub fn spx_rope(
        x: *const spx_array,
        dims: c_int,
        traditional: c_int,
        base: f32,
        scale: f32,
        offset: c_int,
        freqs: *const spx_array,
        out: *mut array,
    ) -> c_int;
    pub fn spx_sdpa(
        q: *const spx_array,
        k: *const spx_array,
        v: *const spx_array,
        scale: f32,
        mask_mode: c_int,
        mask: *const spx_array,
        sinks: *const spx_array,
        out: *mut array,
    ) -> c_int;

    pub fn spx_load_gguf(path: *const c_char, out: *mut *mut spx_map) -> c_int;
    pub fn spx_load_safetensors(path: *const c_char, out: *mut *mut spx_map) -> c_int;
    pub fn spx_map_new() -> *mut spx_map;
    pub fn spx_map_free(m: *mut spx_map);
    pub fn spx_map_len(m: *const spx_map) -> usize;
    pub fn spx_map_key(m: *const spx_map, i: usize) -> *const c_char;
    pub fn spx_map_contains(m: *const spx_map, name: *const c_char) -> c_int;
    pub fn spx_map_get(m: *const spx_map, name: *const c_char, out: *mut array) -> c_int;
    pub fn spx_map_insert(m: *mut spx_map, name: *const c_char, a: *const spx_array) -> c_int;
    pub fn spx_save_safetensors(path: *const c_char, m: *const spx_map) -> c_int;

    pub fn spx_dist_is_available(backend: *const c_char) -> c_int;
    pub fn spx_dist_init(backend: *const c_char, out: *mut *mut spx_group) -> c_int;
    pub fn spx_group_free(g: *mut spx_group);
    pub fn spx_group_rank(g: *const spx_group) -> c_int;
    pub fn spx_group_size(g: *const spx_group) -> c_int;
    pub fn spx_dist_send(
        a: *const spx_array,
        dst: c_int,
        g: *const spx_group,
        out: *mut array,
    ) -> c_int;
    pub fn spx_dist_recv(
        dims: *const c_int,
        ndim: c_int,
        dtype: c_int,
        src: c_int,
        g: *const spx_group,
        out: *mut array,
    ) -> c_int;
    pub fn spx_dist_all_sum(a: *const spx_array, g: *const spx_group, out: *mut array) -> c_int;
}
