//! MLX distributed, `ring` backend: two local processes join one group, sum an
//! array across it, and run a two-stage pipeline of the real model with the
//! hidden state passed from rank 0 to rank 1 by MLX's own send/recv. Rank 1
//! checks the next token against the whole model run in one process.
//!
//! Run without `SHARDPLANE_RING_RANK`, this file is the coordinator: it writes
//! the host file, starts itself twice as ranks 0 and 1, and fails unless both
//! finish well within a time limit.

use std::io::Read;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use shardplane_engine::chat::ChatMessage;
use shardplane_engine::gguf::GgufFile;
use shardplane_engine::mlx::distributed::{Group, is_available};
use shardplane_engine::mlx::{Array, Dtype, MlxStage};
use shardplane_engine::pipeline::TextModel;
use shardplane_engine::{Activations, LoadOptions, Stage, StageInput, StageLayout, StageOutput};

const LIMIT: Duration = Duration::from_secs(180);

fn main() {
    match std::env::var("SHARDPLANE_RING_RANK") {
        Ok(rank) => member(rank.parse().expect("a rank number")),
        Err(_) => coordinate(),
    }
}

fn argmax(logits: &[f32]) -> u32 {
    logits
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .expect("logits")
        .0 as u32
}

fn member(rank: usize) {
    let group = Group::init("ring").expect("the ring group forms");
    assert_eq!((group.rank(), group.size()), (rank, 2), "{group:?}");

    // all_sum: rank r gives r+1 everywhere; both get 1+2.
    let mine = Array::from_f32(&[(rank + 1) as f32; 4], &[4]).unwrap();
    let sum = group.all_sum(&mine).unwrap().to_f32().unwrap();
    assert_eq!(sum, vec![3.0; 4], "rank {rank}: all_sum");

    let file = GgufFile::open(shardplane_testkit::test_model()).unwrap();
    let text = TextModel::from_gguf(&file).unwrap();
    let prompt = text
        .chat_prompt(&[ChatMessage::new("user", "Why is the sky blue?")])
        .unwrap();
    let options = LoadOptions::default();
    let hidden = file.config().hidden_size;
    if rank == 0 {
        let mut stage =
            MlxStage::load_gguf(&file, StageLayout::new(0..15, 30).unwrap(), &options).unwrap();
        let StageOutput::Hidden(h) = stage
            .forward(1, StageInput::Tokens(prompt.clone()))
            .unwrap()
        else {
            panic!("a first stage gives hidden states")
        };
        // The row count first, then the rows.
        let n = Array::from_u32(&[h.tokens as u32], &[1]).unwrap();
        group.send(&n, 1).unwrap();
        group
            .send(&Array::from_f32(&h.data, &[h.tokens, h.hidden]).unwrap(), 1)
            .unwrap();
        let token = group.recv(&[1], Dtype::U32, 1).unwrap().to_f32().unwrap()[0];
        println!(
            "rank 0: sent {} x {hidden} hidden values, next token {token}",
            h.tokens
        );
    } else {
        let mut stage =
            MlxStage::load_gguf(&file, StageLayout::new(15..30, 30).unwrap(), &options).unwrap();
        let n = group.recv(&[1], Dtype::U32, 0).unwrap().to_f32().unwrap()[0] as usize;
        assert_eq!(n, prompt.len(), "rank 1: row count");
        let rows = group
            .recv(&[n, hidden], Dtype::F32, 0)
            .unwrap()
            .to_f32()
            .unwrap();
        let input = StageInput::Hidden(Activations::new(n, hidden, rows).unwrap());
        let StageOutput::Logits(logits) = stage.forward(1, input).unwrap() else {
            panic!("a last stage gives logits")
        };
        let mut whole = MlxStage::load_gguf(&file, StageLayout::whole(30), &options).unwrap();
        let StageOutput::Logits(expected) = whole.forward(1, StageInput::Tokens(prompt)).unwrap()
        else {
            panic!("the whole model gives logits")
        };
        assert_eq!(
            logits, expected,
            "rank 1: logits of the split vs the whole model"
        );
        let token = argmax(&logits);
        group
            .send(&Array::from_u32(&[token], &[1]).unwrap(), 0)
            .unwrap();
        println!("rank 1: next token {token} matches the whole model");
    }
}

fn spawn(rank: usize, hostfile: &std::path::Path) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .env("SHARDPLANE_RING_RANK", rank.to_string())
        .env("MLX_RANK", rank.to_string())
        .env("MLX_HOSTFILE", hostfile)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start a rank")
}

fn coordinate() {
    assert!(
        is_available("ring"),
        "this libmlx has no ring backend: reinstall MLX with `bash scripts/mlx.sh`"
    );
    let dir = tempfile::tempdir().unwrap();
    let hostfile = dir.path().join("hosts.json");
    let ports = [
        shardplane_testkit::free_address(),
        shardplane_testkit::free_address(),
    ];
    let hosts = serde_json::json!([[ports[0].to_string()], [ports[1].to_string()]]);
    std::fs::write(&hostfile, hosts.to_string()).unwrap();
    let mut children: Vec<Child> = (0..2).map(|r| spawn(r, &hostfile)).collect();
    let start = Instant::now();
    let mut done = [None, None];
    while done.iter().any(Option::is_none) {
        for (r, child) in children.iter_mut().enumerate() {
            if done[r].is_none() {
                done[r] = child.try_wait().unwrap();
            }
        }
        if start.elapsed() > LIMIT {
            for c in &mut children {
                let _ = c.kill();
            }
            panic!("the ring ranks did not finish within {LIMIT:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let mut ok = true;
    for (r, child) in children.iter_mut().enumerate() {
        let (mut out, mut err) = (String::new(), String::new());
        child
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        let status = done[r].unwrap();
        println!("rank {r} ({status}): {}", out.trim());
        if !status.success() {
            eprintln!("rank {r} failed:\n{err}");
            ok = false;
        }
    }
    assert!(ok, "a ring rank failed");
    println!(
        "test mlx_ring ... ok ({:.1} s)",
        start.elapsed().as_secs_f64()
    );
}
