//! Copying weights between agents, both ends: a node that needs a model
//! another node's cache holds copies it over the data plane (`ReadBlob`) in
//! pieces on parallel streams, recorded so an interrupted copy resumes; the
//! node that holds it serves those reads from its cache.
//!
//! ```text
//!  needing node: Cache::fetch_from_peer ─ReadBlob(key, offset, length)×COPY_STREAMS─► holder: serve
//!     pieces written in place, recorded in <file>.pieces      ◄── BlobChunk…  (positioned reads)
//!     hashed in order while later pieces travel ─► admitted to the cache
//! ```

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use sha2::{Digest, Sha256};
use shardplane_dataplane as dp;
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::Status;

use crate::cache::{Cache, Failure, hex};
use crate::metrics::Metrics;

/// Bytes per `ReadBlob` chunk.
const BLOB_CHUNK: usize = 1 << 20;

impl Cache {
    /// Copies the model `key` (`size` bytes) from a peer's cache over the
    /// data plane: `PIECE`-sized pieces fetched by `COPY_STREAMS` parallel
    /// streams and written in place. Finished pieces are recorded, so an
    /// interrupted copy resumes with the pieces it lacks. The file is checked
    /// against `sha256` before it is used. `copied(bytes)` counts what arrives.
    pub async fn fetch_from_peer(
        &self,
        peer: &shardplane_dataplane::Client,
        from: &str,
        key: &str,
        size: u64,
        sha256: Option<&str>,
        copied: impl Fn(u64) + Send + Sync + 'static,
    ) -> Result<PathBuf, Failure> {
        let path = self.file_for(key);
        if !path.is_file() {
            let partial = path.with_extension("gguf.partial");
            let io = |e: std::io::Error| Failure {
                reason: "CacheUnwritable",
                message: format!("{}: {e}", partial.display()),
            };
            let done = pieces_done(&partial, size).map_err(io)?;
            self.room(size, size.saturating_sub(done.len() as u64 * PIECE))?;
            let file = std::fs::OpenOptions::new()
                .create(true)
                .truncate(false)
                .write(true)
                .open(&partial)
                .map_err(io)?;
            file.set_len(size).map_err(io)?;
            let pieces = size.div_ceil(PIECE);
            let todo: Vec<u64> = (0..pieces).filter(|p| !done.contains(p)).collect();
            let queue = Arc::new(Mutex::new(todo.into_iter()));
            let file = Arc::new(file);
            let record = Arc::new(Mutex::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(pieces_file(&partial))
                    .map_err(io)?,
            ));
            let copied = Arc::new(copied);
            // The file is hashed in order while later pieces still travel.
            let (finished, hasher) = ordered_hasher(partial.clone(), size, done.clone());
            let workers = (0..COPY_STREAMS).map(|_| {
                let (peer, queue, file, record, copied, finished) = (
                    peer.clone(),
                    queue.clone(),
                    file.clone(),
                    record.clone(),
                    copied.clone(),
                    finished.clone(),
                );
                let key = key.to_string();
                async move {
                    loop {
                        let Some(piece) = queue.lock().expect("queue lock").next() else {
                            return Ok::<(), PieceError>(());
                        };
                        let offset = piece * PIECE;
                        let length = PIECE.min(size - offset);
                        copy_piece(&peer, &key, offset, length, &file, &*copied).await?;
                        file.sync_data()?;
                        writeln!(record.lock().expect("record lock"), "{piece}")?;
                        let _ = finished.send(piece);
                    }
                }
            });
            let copy = futures::future::try_join_all(workers).await;
            drop(finished);
            copy.map_err(|message| Failure {
                reason: "PeerCopyFailed",
                message: format!("copying {key} from {from}: {message}"),
            })?;
            let hashed = hasher
                .await
                .map_err(|e| e.to_string())
                .and_then(|r| r.map_err(|e| e.to_string()))
                .map_err(|e| Failure {
                    reason: "WeightsUnreadable",
                    message: format!("{}: {e}", partial.display()),
                })?;
            std::fs::rename(&partial, &path).map_err(io)?;
            let _ = std::fs::remove_file(pieces_file(&partial));
            return self
                .admit_hashed(
                    key,
                    &path,
                    sha256,
                    Some(hashed),
                    &format!("{key} from {from}"),
                )
                .await;
        }
        self.admit(key, &path, sha256, &format!("{key} from {from}"))
            .await
    }
}

/// Bytes per piece of a peer copy.
pub const PIECE: u64 = 16 << 20;

/// Parallel streams of a peer copy.
pub const COPY_STREAMS: usize = 4;

/// The record of a peer copy's finished pieces, beside its partial file.
pub(crate) fn pieces_file(partial: &Path) -> PathBuf {
    let mut name = partial.as_os_str().to_owned();
    name.push(".pieces");
    PathBuf::from(name)
}

/// The pieces of `partial` already there: those its record lists, or, for a
/// partial file without a record (an interrupted download from a URL), the
/// whole pieces it starts with.
fn pieces_done(partial: &Path, size: u64) -> std::io::Result<std::collections::BTreeSet<u64>> {
    let record = pieces_file(partial);
    let pieces = size.div_ceil(PIECE);
    match std::fs::read_to_string(&record) {
        Ok(text) => Ok(text
            .lines()
            .filter_map(|l| l.trim().parse().ok())
            .filter(|p| *p < pieces)
            .collect()),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let len = std::fs::metadata(partial).map(|m| m.len()).unwrap_or(0);
            let whole = if len >= size { pieces } else { len / PIECE };
            let done: std::collections::BTreeSet<u64> = (0..whole).collect();
            let mut f = std::fs::File::create(&record)?;
            for p in &done {
                writeln!(f, "{p}")?;
            }
            Ok(done)
        }
        Err(e) => Err(e),
    }
}

/// Hashes `path`'s pieces in order as they are reported finished (those in
/// `done` already are); resolves to the file's SHA-256 once every piece has
/// been hashed, or to an error if the reports stop first.
fn ordered_hasher(
    path: PathBuf,
    size: u64,
    done: std::collections::BTreeSet<u64>,
) -> (
    std::sync::mpsc::Sender<u64>,
    tokio::task::JoinHandle<std::io::Result<String>>,
) {
    use std::os::unix::fs::FileExt;
    let (tx, rx) = std::sync::mpsc::channel::<u64>();
    let handle = tokio::task::spawn_blocking(move || {
        let file = std::fs::File::open(&path)?;
        let pieces = size.div_ceil(PIECE);
        let mut ready = done;
        let mut hasher = Sha256::new();
        let mut buf = vec![0u8; PIECE as usize];
        let mut next = 0;
        loop {
            while ready.remove(&next) {
                let offset = next * PIECE;
                let len = PIECE.min(size - offset) as usize;
                file.read_exact_at(&mut buf[..len], offset)?;
                hasher.update(&buf[..len]);
                next += 1;
            }
            if next >= pieces {
                return Ok(hex(&hasher.finalize()));
            }
            match rx.recv() {
                Ok(p) => {
                    ready.insert(p);
                }
                Err(_) => {
                    return Err(std::io::Error::other(
                        "the copy stopped before every piece arrived",
                    ));
                }
            }
        }
    });
    (tx, handle)
}

/// Turns a peer copy's partial file into a plain prefix (for a download from
/// the start of the missing part): keeps the pieces that run on from the start.
pub(crate) fn contiguous_prefix(partial: &Path) -> std::io::Result<()> {
    let record = pieces_file(partial);
    let Ok(text) = std::fs::read_to_string(&record) else {
        return Ok(());
    };
    let done: std::collections::BTreeSet<u64> =
        text.lines().filter_map(|l| l.trim().parse().ok()).collect();
    let run = (0..).take_while(|p| done.contains(p)).count() as u64;
    if let Ok(f) = std::fs::OpenOptions::new().write(true).open(partial) {
        let len = f.metadata()?.len();
        f.set_len((run * PIECE).min(len))?;
    }
    std::fs::remove_file(record)
}

/// Why a piece could not be copied from the peer.
#[derive(Debug, thiserror::Error)]
enum PieceError {
    /// The peer refused the read or broke off the stream.
    #[error("{}", .0.message())]
    Peer(#[from] tonic::Status),
    /// The peer sent bytes out of place.
    #[error("the peer sent bytes at {got} when {expected} was expected")]
    OutOfPlace {
        /// Where the bytes it sent start.
        got: u64,
        /// Where the next bytes belong.
        expected: u64,
    },
    /// The peer ended the stream early.
    #[error("the peer stopped at byte {at} of the piece {start}..{end}")]
    Short {
        /// Where it stopped.
        at: u64,
        /// The piece's first byte.
        start: u64,
        /// One past the piece's last byte.
        end: u64,
    },
    /// The piece cannot be written or recorded here.
    #[error("{0}")]
    Write(#[from] std::io::Error),
}

async fn copy_piece(
    peer: &shardplane_dataplane::Client,
    key: &str,
    offset: u64,
    length: u64,
    file: &std::fs::File,
    copied: &(dyn Fn(u64) + Send + Sync),
) -> Result<(), PieceError> {
    use std::os::unix::fs::FileExt;
    // A peer that is alive but sends nothing fails the piece (and the copy
    // goes to the next source) instead of holding the model's fetch lock.
    let idle = |what: &str| {
        PieceError::Peer(tonic::Status::deadline_exceeded(format!(
            "the peer sent nothing for {} s {what}",
            crate::cache::DOWNLOAD_IDLE.as_secs()
        )))
    };
    let mut stream = tokio::time::timeout(
        crate::cache::DOWNLOAD_IDLE,
        peer.clone()
            .read_blob(shardplane_dataplane::ReadBlobRequest {
                key: key.to_string(),
                offset,
                length,
            }),
    )
    .await
    .map_err(|_| idle("after the read was asked"))??
    .into_inner();
    let mut at = offset;
    while let Some(chunk) = tokio::time::timeout(crate::cache::DOWNLOAD_IDLE, stream.message())
        .await
        .map_err(|_| idle("mid-piece"))??
    {
        if chunk.offset != at || at + chunk.data.len() as u64 > offset + length {
            return Err(PieceError::OutOfPlace {
                got: chunk.offset,
                expected: at,
            });
        }
        file.write_all_at(&chunk.data, at)?;
        at += chunk.data.len() as u64;
        copied(chunk.data.len() as u64);
    }
    if at != offset + length {
        return Err(PieceError::Short {
            at,
            start: offset,
            end: offset + length,
        });
    }
    Ok(())
}

/// The stream answering a `ReadBlob` of `length` bytes of `path` from
/// `offset` (to the end when 0), read on a blocking thread.
pub fn serve(
    path: PathBuf,
    offset: u64,
    length: u64,
    metrics: Metrics,
) -> ReceiverStream<Result<dp::BlobChunk, Status>> {
    let (chunks, stream) = mpsc::channel(8);
    tokio::task::spawn_blocking(move || {
        if let Err(e) = send_blob(&path, offset, length, &chunks, &metrics) {
            let _ = chunks.blocking_send(Err(e));
        }
    });
    ReceiverStream::new(stream)
}

/// Streams `length` bytes of `path` from `offset` (to the end when 0) in
/// `BLOB_CHUNK` pieces, read on a thread of its own with positioned reads.
fn send_blob(
    path: &Path,
    offset: u64,
    length: u64,
    chunks: &mpsc::Sender<Result<dp::BlobChunk, Status>>,
    metrics: &Metrics,
) -> Result<(), Status> {
    use std::os::unix::fs::FileExt;
    let io = |e: std::io::Error| Status::internal(format!("{}: {e}", path.display()));
    let file = std::fs::File::open(path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    if offset > size {
        return Err(Status::out_of_range(format!(
            "offset {offset} is past the file's {size} bytes"
        )));
    }
    let end = if length == 0 {
        size
    } else {
        offset.saturating_add(length).min(size)
    };
    let mut at = offset;
    let mut first = true;
    while at < end || first {
        let n = ((end - at) as usize).min(BLOB_CHUNK);
        let mut data = vec![0; n];
        file.read_exact_at(&mut data, at).map_err(io)?;
        let chunk = dp::BlobChunk {
            offset: at,
            data: data.into(),
            size: if first { size } else { 0 },
        };
        first = false;
        at += n as u64;
        metrics.blob_bytes_served.inc_by(n as u64);
        if chunks.blocking_send(Ok(chunk)).is_err() {
            break;
        }
    }
    Ok(())
}
