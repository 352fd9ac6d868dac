//! Downloading a model file from a URL into the cache's partial file, one
//! request at a time, resuming where the file stops:
//!
//! ```text
//!  GET url (Range: bytes=<partial length>- when there is a partial file)
//!   ├─ 206, Content-Range starts there ──► append            ─┐
//!   ├─ 200 (Range ignored) ─────────────► truncate, from 0  ─┤ size checked against
//!   ├─ 416 ─────────────────────────────► drop partial, again │ budget and free disk
//!   ├─ 408/429/5xx, cut or stalled body ► pause, again (resumes) before a byte is written
//!   └─ other 4xx, 206 from elsewhere ───► Failure
//! ```
//!
//! The HTTP client has a connect and an idle timeout, never a total one
//! (`shardplane_models::download_client`): a stalled transfer errors after
//! the idle time and is resumed after a pause (1 s growing to 30 s); the
//! download gives up after [`PAUSES`]`.len() + 1` tries in a row that
//! brought no byte.

use std::io::Write;
use std::path::Path;
use std::time::Duration;

use futures::StreamExt;
use reqwest::StatusCode;
use reqwest::header::{CONTENT_RANGE, RANGE};

use crate::cache::Failure;

/// Pauses between tries that brought nothing; a try that brought bytes
/// starts the sequence again.
pub const PAUSES: [Duration; 6] = [
    Duration::from_secs(1),
    Duration::from_secs(2),
    Duration::from_secs(4),
    Duration::from_secs(8),
    Duration::from_secs(15),
    Duration::from_secs(30),
];

/// How one try ended short of the whole file.
enum Stop {
    /// Worth another try (`progressed`: this one wrote bytes).
    Again { why: String, progressed: bool },
    /// Trying again would not help.
    Fail(Failure),
}

/// Downloads `url` into `partial` until it holds the whole file. `room(size,
/// remaining)` is asked before a byte is written, once the file's size is
/// known; `progress(done, size)` follows the transfer.
pub async fn download(
    http: &reqwest::Client,
    url: &str,
    partial: &Path,
    room: impl Fn(u64, u64) -> Result<(), Failure>,
    progress: &mut impl FnMut(u64, Option<u64>),
) -> Result<(), Failure> {
    let mut barren = 0;
    loop {
        match attempt(http, url, partial, &room, progress).await {
            Ok(()) => return Ok(()),
            Err(Stop::Fail(f)) => return Err(f),
            Err(Stop::Again { why, progressed }) => {
                if progressed {
                    barren = 0;
                }
                let Some(pause) = PAUSES.get(barren) else {
                    return Err(Failure {
                        reason: "DownloadFailed",
                        message: format!(
                            "GET {url}: {why} ({} tries in a row brought nothing)",
                            barren + 1
                        ),
                    });
                };
                barren += 1;
                tracing::warn!(%url, %why, ?pause, "download interrupted; resuming after a pause");
                tokio::time::sleep(*pause).await;
            }
        }
    }
}

/// One request: appends to `partial` (or starts it over) as far as the
/// transfer goes.
async fn attempt(
    http: &reqwest::Client,
    url: &str,
    partial: &Path,
    room: &impl Fn(u64, u64) -> Result<(), Failure>,
    progress: &mut impl FnMut(u64, Option<u64>),
) -> Result<(), Stop> {
    let unwritable = |e: std::io::Error| {
        Stop::Fail(Failure {
            reason: "CacheUnwritable",
            message: format!("{}: {e}", partial.display()),
        })
    };
    let failed = |message: String| {
        Stop::Fail(Failure {
            reason: "DownloadFailed",
            message: format!("GET {url}: {message}"),
        })
    };
    let offset = std::fs::metadata(partial).map(|m| m.len()).unwrap_or(0);
    let mut request = http.get(url);
    if offset > 0 {
        request = request.header(RANGE, format!("bytes={offset}-"));
    }
    let response = request.send().await.map_err(|e| Stop::Again {
        why: chain(&e),
        progressed: false,
    })?;
    let status = response.status();
    if status == StatusCode::RANGE_NOT_SATISFIABLE && offset > 0 {
        // The partial file is as long as what the server has, or longer: it
        // is not a prefix of the file as it is now.
        std::fs::remove_file(partial).map_err(unwritable)?;
        return Err(Stop::Again {
            why: format!("HTTP {status} for the bytes from {offset} on; starting over"),
            progressed: true,
        });
    }
    if status == StatusCode::REQUEST_TIMEOUT
        || status == StatusCode::TOO_MANY_REQUESTS
        || status.is_server_error()
    {
        return Err(Stop::Again {
            why: format!("HTTP {status}"),
            progressed: false,
        });
    }
    if !status.is_success() {
        return Err(failed(format!("HTTP {status}")));
    }
    let length = response.content_length();
    let (start, size) = if status == StatusCode::PARTIAL_CONTENT {
        let header = response
            .headers()
            .get(CONTENT_RANGE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or_default();
        match content_range(header) {
            Some((first, last, size))
                if first == offset && length.is_none_or(|n| n == last - first + 1) =>
            {
                (first, size)
            }
            _ => {
                return Err(failed(format!(
                    "asked for the bytes from {offset} on, the server answered 206 with \
                     Content-Range {header:?}; refusing to splice that onto the partial file"
                )));
            }
        }
    } else {
        if offset > 0 {
            tracing::info!(%url, offset, "the server ignored the range; downloading from the start");
        }
        (0, length)
    };
    if let Some(size) = size {
        room(size, size - start).map_err(Stop::Fail)?;
    }
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .write(true)
        .append(start > 0)
        .truncate(start == 0)
        .open(partial)
        .map_err(unwritable)?;
    let mut done = start;
    progress(done, size);
    let mut stream = response.bytes_stream();
    let mut last = std::time::Instant::now();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| Stop::Again {
            why: chain(&e),
            progressed: done > start,
        })?;
        file.write_all(&chunk).map_err(unwritable)?;
        done += chunk.len() as u64;
        if last.elapsed() >= Duration::from_millis(500) {
            progress(done, size);
            last = std::time::Instant::now();
        }
    }
    progress(done, size);
    match size {
        Some(size) if size != done => Err(Stop::Again {
            why: format!("the transfer stopped at {done} of {size} bytes"),
            progressed: done > start,
        }),
        _ => Ok(()),
    }
}

/// `bytes first-last/size` (`size` may be `*`), checked for order.
fn content_range(value: &str) -> Option<(u64, u64, Option<u64>)> {
    let (range, size) = value.trim().strip_prefix("bytes ")?.split_once('/')?;
    let (first, last) = range.split_once('-')?;
    let (first, last): (u64, u64) = (first.trim().parse().ok()?, last.trim().parse().ok()?);
    let size = match size.trim() {
        "*" => None,
        s => Some(s.parse::<u64>().ok()?),
    };
    (first <= last && size.is_none_or(|s| last < s)).then_some((first, last, size))
}

/// An error with its causes ("error decoding response body: operation timed out").
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// A model of `size` bytes fits a cache of `budget` bytes at all.
pub fn within_budget(size: u64, budget: Option<u64>) -> Result<(), Failure> {
    match budget {
        Some(budget) if size > budget => Err(Failure {
            reason: "ModelTooLarge",
            message: format!(
                "the model is {size} bytes, more than the cache budget of {budget} bytes \
                 (the agent's --cache-budget)"
            ),
        }),
        _ => Ok(()),
    }
}

/// `remaining` bytes still to write fit the `free` bytes left on `dir`'s disk.
pub fn on_disk(remaining: u64, free: u64, dir: &Path) -> Result<(), Failure> {
    if remaining > free {
        return Err(Failure {
            reason: "DiskFull",
            message: format!(
                "{remaining} bytes are still to download, only {free} bytes are free on {}",
                dir.display()
            ),
        });
    }
    Ok(())
}

/// Bytes an unprivileged writer may still use on the disk holding `dir`.
pub fn free_space(dir: &Path) -> std::io::Result<u64> {
    let stat = rustix::fs::statvfs(dir)?;
    Ok(stat.f_bavail.saturating_mul(stat.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{BufRead, BufReader};
    use std::net::TcpListener;
    use std::sync::{Arc, Mutex};

    /// What the test server answers: the head (status line and headers),
    /// the body, and whether to then hold the connection without a byte.
    struct Reply {
        head: String,
        body: Vec<u8>,
        stall: bool,
    }

    /// The test file: bytes that differ from their neighbours.
    fn file(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i * 31 % 251) as u8).collect()
    }

    fn whole(file: &[u8]) -> Reply {
        Reply {
            head: format!("HTTP/1.1 200 OK\r\nContent-Length: {}\r\n", file.len()),
            body: file.to_vec(),
            stall: false,
        }
    }

    fn from(file: &[u8], first: u64) -> Reply {
        let len = file.len() as u64;
        Reply {
            head: format!(
                "HTTP/1.1 206 Partial Content\r\nContent-Length: {}\r\nContent-Range: bytes {first}-{}/{len}\r\n",
                len - first,
                len - 1
            ),
            body: file[first as usize..].to_vec(),
            stall: false,
        }
    }

    fn status(line: &str) -> Reply {
        Reply {
            head: format!("HTTP/1.1 {line}\r\nContent-Length: 0\r\n"),
            body: Vec::new(),
            stall: false,
        }
    }

    /// An HTTP/1.1 server answering request `n` (with the Range start it
    /// asked for) as `script` says; returns its URL and the ranges asked.
    type Script = dyn Fn(usize, Option<u64>) -> Reply + Send + Sync;

    fn serve(script: Box<Script>) -> (String, Arc<Mutex<Vec<Option<u64>>>>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}/model.gguf", listener.local_addr().unwrap());
        let asked: Arc<Mutex<Vec<Option<u64>>>> = Default::default();
        let (script, seen) = (Arc::new(script), asked.clone());
        std::thread::spawn(move || {
            for stream in listener.incoming() {
                let mut stream = stream.unwrap();
                let mut range = None;
                let mut reader = BufReader::new(stream.try_clone().unwrap());
                loop {
                    let mut line = String::new();
                    if reader.read_line(&mut line).unwrap() == 0 || line.trim().is_empty() {
                        break;
                    }
                    let lower = line.to_ascii_lowercase();
                    if let Some(v) = lower.strip_prefix("range: bytes=") {
                        range = v.trim().trim_end_matches('-').parse().ok();
                    }
                }
                let n = {
                    let mut seen = seen.lock().unwrap();
                    seen.push(range);
                    seen.len() - 1
                };
                let reply = script(n, range);
                let head = format!("{}Connection: close\r\n\r\n", reply.head);
                let _ = stream.write_all(head.as_bytes());
                let _ = stream.write_all(&reply.body);
                let _ = stream.flush();
                if reply.stall {
                    std::thread::spawn(move || {
                        std::thread::sleep(Duration::from_secs(20));
                        drop(stream);
                    });
                }
            }
        });
        (url, asked)
    }

    async fn fetch(url: &str, partial: &Path, budget: Option<u64>) -> Result<(), Failure> {
        let http = shardplane_models::download_client(Duration::from_millis(300)).unwrap();
        download(
            &http,
            url,
            partial,
            |size, _| within_budget(size, budget),
            &mut |_, _| {},
        )
        .await
    }

    #[tokio::test]
    async fn a_stalled_or_cut_transfer_resumes_where_it_stopped() {
        let data = file(300_000);
        let served = data.clone();
        let (url, asked) = serve(Box::new(move |n, range| match n {
            // Stalls after a third, then breaks off after two thirds.
            0 | 1 => {
                let first = range.unwrap_or(0) as usize;
                let mut reply = from(&served, first as u64);
                if n == 0 {
                    reply = whole(&served);
                }
                reply.body.truncate(100_000);
                reply.stall = n == 0;
                reply
            }
            _ => from(&served, range.unwrap()),
        }));
        let dir = tempfile::tempdir().unwrap();
        let partial = dir.path().join("m.gguf.partial");
        fetch(&url, &partial, None).await.unwrap();
        assert_eq!(std::fs::read(&partial).unwrap(), data);
        let asked = asked.lock().unwrap().clone();
        assert_eq!(asked, [None, Some(100_000), Some(200_000)]);
    }

    #[tokio::test]
    async fn a_server_that_ignores_range_starts_the_file_over() {
        let data = file(50_000);
        let served = data.clone();
        let (url, asked) = serve(Box::new(move |_, _| whole(&served)));
        let dir = tempfile::tempdir().unwrap();
        let partial = dir.path().join("m.gguf.partial");
        std::fs::write(&partial, vec![0xEE; 5000]).unwrap();
        fetch(&url, &partial, None).await.unwrap();
        assert_eq!(std::fs::read(&partial).unwrap(), data);
        assert_eq!(*asked.lock().unwrap(), [Some(5000)]);
    }

    #[tokio::test]
    async fn a_206_from_another_offset_is_refused_and_the_partial_file_kept() {
        let data = file(50_000);
        let served = data.clone();
        let (url, asked) = serve(Box::new(move |_, _| from(&served, 0)));
        let dir = tempfile::tempdir().unwrap();
        let partial = dir.path().join("m.gguf.partial");
        std::fs::write(&partial, &data[..5000]).unwrap();
        let failure = fetch(&url, &partial, None).await.unwrap_err();
        assert_eq!(failure.reason, "DownloadFailed");
        assert!(
            failure.message.contains("bytes 0-49999/50000"),
            "{}",
            failure.message
        );
        assert_eq!(std::fs::read(&partial).unwrap(), &data[..5000]);
        assert_eq!(asked.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_partial_file_the_server_cannot_continue_is_dropped() {
        let data = file(50_000);
        let served = data.clone();
        let (url, asked) = serve(Box::new(move |_, range| match range {
            Some(_) => status("416 Range Not Satisfiable"),
            None => whole(&served),
        }));
        let dir = tempfile::tempdir().unwrap();
        let partial = dir.path().join("m.gguf.partial");
        std::fs::write(&partial, vec![1; 60_000]).unwrap();
        fetch(&url, &partial, None).await.unwrap();
        assert_eq!(std::fs::read(&partial).unwrap(), data);
        assert_eq!(*asked.lock().unwrap(), [Some(60_000), None]);
    }

    #[tokio::test]
    async fn server_errors_are_tried_again_and_client_errors_are_not() {
        let data = file(10_000);
        let served = data.clone();
        let (url, asked) = serve(Box::new(move |n, _| match n {
            0 => status("503 Service Unavailable"),
            _ => whole(&served),
        }));
        let dir = tempfile::tempdir().unwrap();
        let partial = dir.path().join("a.partial");
        fetch(&url, &partial, None).await.unwrap();
        assert_eq!(std::fs::read(&partial).unwrap(), data);
        assert_eq!(asked.lock().unwrap().len(), 2);

        let (url, asked) = serve(Box::new(|_, _| status("404 Not Found")));
        let failure = fetch(&url, &dir.path().join("b.partial"), None)
            .await
            .unwrap_err();
        assert_eq!(failure.reason, "DownloadFailed");
        assert!(failure.message.contains("404"), "{}", failure.message);
        assert_eq!(asked.lock().unwrap().len(), 1);
    }

    #[tokio::test]
    async fn a_model_over_the_cache_budget_fails_before_a_byte_is_written() {
        let served = file(5000);
        let (url, _) = serve(Box::new(move |_, _| whole(&served)));
        let dir = tempfile::tempdir().unwrap();
        let http = shardplane_models::download_client(Duration::from_secs(5)).unwrap();
        let cache = crate::cache::Cache::new(dir.path().into(), http)
            .unwrap()
            .with_budget(Some(1000));
        let failure = cache
            .fetch("k", &url, None, None, |_, _| {})
            .await
            .unwrap_err();
        assert_eq!(failure.reason, "ModelTooLarge");
        assert!(
            failure.message.contains("5000 bytes") && failure.message.contains("1000 bytes"),
            "{}",
            failure.message
        );
        assert!(!cache.file_for("k").with_extension("gguf.partial").exists());
    }

    #[test]
    fn content_ranges_and_room() {
        assert_eq!(content_range("bytes 5-9/10"), Some((5, 9, Some(10))));
        assert_eq!(content_range("bytes 5-9/*"), Some((5, 9, None)));
        assert_eq!(content_range("bytes 9-5/10"), None);
        assert_eq!(content_range("bytes 5-10/10"), None);
        assert_eq!(content_range("items 5-9/10"), None);
        assert_eq!(content_range(""), None);
        let dir = Path::new("/cache");
        assert!(on_disk(10, 10, dir).is_ok());
        let full = on_disk(11, 10, dir).unwrap_err();
        assert_eq!(full.reason, "DiskFull");
        assert!(
            full.message.contains("11 bytes") && full.message.contains("only 10 bytes are free")
        );
        assert!(within_budget(10, None).is_ok() && within_budget(10, Some(10)).is_ok());
        let tmp = tempfile::tempdir().unwrap();
        assert!(free_space(tmp.path()).unwrap() > 0);
    }
}
