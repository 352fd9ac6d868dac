//! MLX distributed: a group of processes that send, receive and sum arrays.
//!
//! The `ring` backend connects processes over TCP. Each process is told its
//! rank by `MLX_RANK` and the group by `MLX_HOSTFILE`, a JSON list with one
//! list of `host:port` addresses per rank, e.g.
//! `[["127.0.0.1:5000"], ["127.0.0.1:5001"]]`. On Macs the `jaccl` backend does
//! the same over RDMA on Thunderbolt (untested here).
#![allow(unsafe_code)]

use std::ffi::c_int;
use std::ptr::NonNull;

use super::array::{Array, Dtype, c_string, check, dims, make};
use super::ffi;
use crate::error::{Error, Result};

/// Whether this libmlx was built with `backend` (`ring`, `mpi`, `jaccl`, `nccl`, `any`).
pub fn is_available(backend: &str) -> bool {
    match c_string(backend) {
        // SAFETY: `b` outlives the call.
        Ok(b) => unsafe { ffi::spx_dist_is_available(b.as_ptr()) == 1 },
        Err(_) => false,
    }
}

/// This process's place in a group of processes.
pub struct Group(NonNull<ffi::spx_group>);

// SAFETY: a handle on MLX's group object; its use is serialized by the caller
// (the operations below block until the transfer is done).
unsafe impl Send for Group {}

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: freed exactly once.
        unsafe { ffi::spx_group_free(self.0.as_ptr()) }
    }
}

impl std::fmt::Debug for Group {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Group(rank {} of {})", self.rank(), self.size())
    }
}

impl Group {
    /// Joins the group described by the environment (`MLX_RANK`,
    /// `MLX_HOSTFILE` for `ring`); blocks until every rank has connected.
    /// Fails, rather than falling back to a group of one, when the backend
    /// cannot start.
    pub fn init(backend: &str) -> Result<Group> {
        let b = c_string(backend)?;
        let mut out = std::ptr::null_mut();
        // SAFETY: `b` outlives the call.
        check(
            unsafe { ffi::spx_dist_init(b.as_ptr(), &mut out) },
            &format!("distributed init ({backend})"),
        )?;
        NonNull::new(out)
            .map(Group)
            .ok_or_else(|| Error::Mlx("distributed init: no group".into()))
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        // SAFETY: live handle.
        unsafe { ffi::spx_group_rank(self.0.as_ptr()) }.max(0) as usize
    }

    /// Processes in the group.
    pub fn size(&self) -> usize {
        // SAFETY: live handle.
        unsafe { ffi::spx_group_size(self.0.as_ptr()) }.max(0) as usize
    }

    fn check_rank(&self, peer: usize) -> Result<c_int> {
        if peer >= self.size() || peer == self.rank() {
            return Err(Error::InvalidInput(format!(
                "rank {peer} is not another member of a group of {} (this is rank {})",
                self.size(),
                self.rank()
            )));
        }
        Ok(peer as c_int)
    }

    /// Sends `a` to rank `dst`; returns once it is sent.
    pub fn send(&self, a: &Array, dst: usize) -> Result<()> {
        let dst = self.check_rank(dst)?;
        // SAFETY: live handles for the call.
        let sent = make("send", |out| unsafe {
            ffi::spx_dist_send(a.ptr(), dst, self.0.as_ptr(), out)
        })?;
        Array::eval(&[&sent])
    }

    /// Receives an array of `shape` and `dtype` from rank `src`.
    pub fn recv(&self, shape: &[usize], dtype: Dtype, src: usize) -> Result<Array> {
        let src = self.check_rank(src)?;
        let d = dims(shape)?;
        // SAFETY: `d` and the group outlive the call.
        let a = make("recv", |out| unsafe {
            ffi::spx_dist_recv(
                d.as_ptr(),
                d.len() as c_int,
                dtype as c_int,
                src,
                self.0.as_ptr(),
                out,
            )
        })?;
        Array::eval(&[&a])?;
        Ok(a)
    }

    /// The element-wise sum of `a` over every rank (each rank gets the sum).
    pub fn all_sum(&self, a: &Array) -> Result<Array> {
        // SAFETY: live handles for the call.
        let s = make("all_sum", |out| unsafe {
            ffi::spx_dist_all_sum(a.ptr(), self.0.as_ptr(), out)
        })?;
        Array::eval(&[&s])?;
        Ok(s)
    }
}
