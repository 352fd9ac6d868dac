//! A tensor group's ranks joined by the data plane's mesh: the collective a
//! rank sums with, the leader's followers reached through it, and the loop a
//! follower runs. The same code serves ranks on separate agents (see
//! `shards::tensor`) and ranks on one machine (`shardplane generate
//! --tensor-processes`).
//!
//! ```text
//!   leader (rank 0)                         follower (rank k)
//!   TensorGroup::led(stage, MeshFollowers)  follow(stage, mesh)
//!     start: command ──── mesh message ───►   obey (its share; all-reduces
//!     finish: reply  ◄─── mesh message ────    with every rank meanwhile)
//!   SharedMesh: one mesh behind a lock, joined after loading; the first
//!   error on it marks it broken (and tells whoever asked to hear of it)
//! ```

use std::sync::{Arc, Mutex, OnceLock};

use shardplane_dataplane::collective::{Mesh, MeshCloser};
use shardplane_engine::tensor::command::{decode_reply, encode_reply};
use shardplane_engine::tensor::{AllReduce, Command, Followers, Reply};
use shardplane_engine::{Error, Stage};

/// Called once, with why, when a mesh first fails.
pub type OnBroken = Box<dyn FnOnce(String) + Send>;

/// A mesh the ranks' collectives and the group's commands share, joined
/// after the stage is loaded (loading takes longer than any peer waits).
#[derive(Clone, Default)]
pub struct SharedMesh {
    mesh: Arc<Mutex<Option<Mesh>>>,
    closer: Arc<Mutex<Option<MeshCloser>>>,
    broken: Arc<OnceLock<String>>,
    on_broken: Arc<Mutex<Option<OnBroken>>>,
}

impl SharedMesh {
    /// The collective of a rank loaded before the mesh is joined.
    pub fn collective(&self) -> Box<dyn AllReduce> {
        let mesh = self.clone();
        Box::new(move |values: &mut [f32]| {
            mesh.with(|m| m.all_reduce(values).map_err(|e| e.to_string()))
        })
    }

    /// Runs `f` on the mesh; an error it returns marks the mesh broken.
    pub fn with<T>(&self, f: impl FnOnce(&mut Mesh) -> Result<T, String>) -> Result<T, String> {
        if let Some(why) = self.broken.get() {
            return Err(format!("the tensor group is broken: {why}"));
        }
        let result = {
            let mut slot = self
                .mesh
                .lock()
                .map_err(|_| "the mesh's lock is poisoned".to_string())?;
            match slot.as_mut() {
                Some(mesh) => f(mesh),
                None => Err("the tensor group has not joined (or has left)".into()),
            }
        };
        if let Err(why) = &result {
            self.break_with(why);
        }
        result
    }

    /// Puts the joined mesh in place (or takes it away: `None`).
    pub fn set(&self, mesh: Option<Mesh>) {
        let closer = mesh.as_ref().and_then(|m| m.closer().ok());
        if let Ok(mut slot) = self.closer.lock() {
            *slot = closer;
        }
        if let Ok(mut slot) = self.mesh.lock() {
            *slot = mesh;
        }
    }

    /// Shuts the mesh's connections without waiting for whoever uses it (a
    /// follower blocked on its leader's next command wakes and ends).
    pub fn close(&self) {
        if let Ok(slot) = self.closer.lock()
            && let Some(closer) = slot.as_ref()
        {
            closer.close();
        }
    }

    /// Calls `f` (once) when the mesh first fails; at once when it has.
    pub fn on_broken(&self, f: OnBroken) {
        match self.broken.get() {
            Some(why) => f(why.clone()),
            None => {
                if let Ok(mut slot) = self.on_broken.lock() {
                    *slot = Some(f);
                }
                // It may have broken meanwhile.
                if let Some(why) = self.broken.get() {
                    self.fire(why.clone());
                }
            }
        }
    }

    /// Looks every `every` whether a peer has gone while the mesh is idle
    /// (on a thread, until the mesh breaks or is taken away): a leader
    /// between requests reads nothing, so without this it would hear of a
    /// dead follower only when its next request fails. A look never waits
    /// for the mesh (it skips the turn while a step holds it); one between a
    /// step's messages is harmless (a reply waiting is left to be read).
    pub fn watch_idle(&self, every: std::time::Duration) -> std::io::Result<()> {
        let mesh = self.clone();
        std::thread::Builder::new()
            .name("tensor-idle-watch".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(every);
                    if mesh.broken().is_some() {
                        return;
                    }
                    let checked = match mesh.mesh.try_lock() {
                        Ok(slot) => match slot.as_ref() {
                            Some(m) => m.check_idle().map_err(|e| e.to_string()),
                            None => return,
                        },
                        Err(std::sync::TryLockError::WouldBlock) => Ok(()),
                        Err(std::sync::TryLockError::Poisoned(_)) => return,
                    };
                    if let Err(why) = checked {
                        mesh.break_with(&why);
                        return;
                    }
                }
            })
            .map(drop)
    }

    /// This rank (0 before the mesh is joined).
    pub fn rank(&self) -> usize {
        self.mesh
            .lock()
            .ok()
            .and_then(|m| m.as_ref().map(Mesh::rank))
            .unwrap_or(0)
    }

    /// This mesh's identity (another load of the same Shard has another).
    pub fn id(&self) -> usize {
        Arc::as_ptr(&self.mesh) as usize
    }

    /// Why the mesh failed, once it has.
    pub fn broken(&self) -> Option<&str> {
        self.broken.get().map(String::as_str)
    }

    /// Marks the mesh broken for `why` (the first reason stays).
    pub fn break_with(&self, why: &str) {
        if self.broken.set(why.to_string()).is_ok() {
            self.fire(why.to_string());
        }
    }

    fn fire(&self, why: String) {
        let f = self.on_broken.lock().ok().and_then(|mut slot| slot.take());
        if let Some(f) = f {
            f(why);
        }
    }
}

/// A leader's followers: ranks 1 and up, reached through its mesh.
pub struct MeshFollowers {
    mesh: SharedMesh,
    started: Vec<bool>,
}

impl MeshFollowers {
    /// The `ranks - 1` followers of rank 0 on `mesh`.
    pub fn new(mesh: SharedMesh, ranks: usize) -> Self {
        MeshFollowers {
            mesh,
            started: vec![false; ranks.saturating_sub(1)],
        }
    }

    /// Shuts the mesh: the followers' loops end.
    pub fn close(&self) {
        self.mesh.close();
        self.mesh.set(None);
    }
}

impl Followers for MeshFollowers {
    fn count(&self) -> usize {
        self.started.len()
    }

    fn start(&mut self, command: &Command) {
        let bytes = command.encode();
        for (i, started) in self.started.iter_mut().enumerate() {
            *started = self
                .mesh
                .with(|m| m.send_message(i + 1, &bytes).map_err(|e| e.to_string()))
                .is_ok();
        }
    }

    fn finish(&mut self) -> Vec<Reply> {
        (0..self.started.len())
            .map(|i| {
                if !self.started[i] {
                    return Err((false, "unreachable".into()));
                }
                let reply = self.mesh.with(|m| match m.receive_message(i + 1, false) {
                    Ok(Some(bytes)) => decode_reply(&bytes).map_err(|e| e.to_string()),
                    Ok(None) => Err(format!("rank {} has gone", i + 1)),
                    Err(e) => Err(e.to_string()),
                });
                reply.unwrap_or_else(|e| Err((false, e)))
            })
            .collect()
    }
}

impl Drop for MeshFollowers {
    fn drop(&mut self) {
        self.close();
    }
}

/// A follower's loop: runs the leader's commands on `stage` until the
/// leader leaves (`Ok`) or the mesh fails (`Err`).
pub fn follow(stage: &mut dyn Stage, mesh: &SharedMesh) -> shardplane_engine::Result<()> {
    shardplane_engine::tensor::follow(
        stage,
        || {
            mesh.with(|m| m.receive_message(0, true).map_err(|e| e.to_string()))
                .map_err(Error::Unavailable)?
                .map(|bytes| Command::decode(&bytes))
                .transpose()
        },
        |reply| {
            mesh.with(|m| {
                m.send_message(0, &encode_reply(reply))
                    .map_err(|e| e.to_string())
            })
            .map_err(Error::Unavailable)
        },
    )
}
