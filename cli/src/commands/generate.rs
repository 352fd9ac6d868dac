//! `shardplane generate`: text from a model on this machine.

use std::io::Write;

use clap::Args;
use shardplane_engine::answer::{AnswerReader, Split};
use shardplane_engine::chat::{ChatMessage, ChatOptions};
use shardplane_engine::constraint::Grammar;
use shardplane_engine::generation::ValidRequest;
use shardplane_engine::pipeline::{FinishReason, generate_request};
use shardplane_engine::sampler::SamplingParams;

use super::model_args::ModelArgs;

/// Options of `shardplane generate`.
#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt.
    #[arg(long)]
    prompt: String,
    /// Send the prompt as a user message through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// A system message (with --chat).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// The most tokens to generate.
    #[arg(long, default_value_t = 256)]
    max_tokens: usize,
    /// 0 is greedy; higher is more random.
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,
    /// Nucleus sampling: keep the most likely tokens adding up to this probability.
    #[arg(long)]
    top_p: Option<f32>,
    /// Keep only the K most likely tokens.
    #[arg(long)]
    top_k: Option<usize>,
    /// Drop tokens less likely than this fraction of the most likely one.
    #[arg(long)]
    min_p: Option<f32>,
    /// Penalize tokens already seen (1 is off).
    #[arg(long, default_value_t = 1.0)]
    repetition_penalty: f32,
    /// Seed for sampling.
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when this text appears (repeatable).
    #[arg(long)]
    stop: Vec<String>,
    /// The output must be JSON valid against the JSON Schema in this file.
    #[arg(long, group = "grammar")]
    json_schema: Option<std::path::PathBuf>,
    /// The output must be a JSON object.
    #[arg(long, group = "grammar")]
    json: bool,
    /// The output must match this regular expression.
    #[arg(long, group = "grammar")]
    regex: Option<String>,
    /// Print the generated token ids to stderr.
    #[arg(long)]
    print_tokens: bool,
    /// Generate on a running pipeline instead: the data-plane endpoint
    /// (`host:port`) of its head stage.
    #[arg(long, requires_all = ["shard", "token_file"])]
    endpoint: Option<String>,
    /// The head Shard, `namespace/name` (with `--endpoint`).
    #[arg(long)]
    shard: Option<String>,
    /// The data-plane token file (with `--endpoint`).
    #[arg(long, env = "SHARDPLANE_DATA_PLANE_TOKEN_FILE")]
    token_file: Option<std::path::PathBuf>,
    #[command(flatten)]
    remote_tls: super::tls_args::RemoteTls,
}

impl GenerateArgs {
    /// The output grammar the options ask for, if any.
    fn grammar(&self) -> anyhow::Result<Option<Grammar>> {
        use anyhow::Context;
        Ok(if let Some(path) = &self.json_schema {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let schema = serde_json::from_str(&text)
                .with_context(|| format!("{} is not JSON", path.display()))?;
            Some(Grammar::JsonSchema(schema))
        } else if self.json {
            Some(Grammar::JsonObject)
        } else {
            self.regex.clone().map(Grammar::Regex)
        })
    }
}

/// Generates and streams the text to stdout.
pub fn run(args: GenerateArgs) -> anyhow::Result<()> {
    if let Some(endpoint) = &args.endpoint {
        return remote(&args, endpoint);
    }
    args.model.use_threads(None)?;
    let (mut pipeline, text) = args.model.load()?;
    let prompt = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system));
        }
        messages.push(ChatMessage::new("user", &args.prompt));
        text.chat_prompt(&messages)?
    } else {
        text.raw_prompt(&args.prompt)?
    };
    let params = SamplingParams {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        min_p: args.min_p,
        repetition_penalty: args.repetition_penalty,
        seed: args.seed,
        max_tokens: args.max_tokens,
        stop: args.stop.clone(),
        ..Default::default()
    };
    let mut request = ValidRequest::new(
        prompt.clone(),
        Vec::new(),
        params,
        text.tokenizer.vocab_size(),
        pipeline.context_length(),
    )?;
    // A chat with a harmony model (gpt-oss) keeps its channels around a
    // grammar, and its answer is read out of them: the reasoning to stderr,
    // the answer to stdout.
    let harmony = args.chat && text.harmony();
    let grammar = match args.grammar()? {
        Some(g) if harmony => text.answer_grammar(Some(g), None, Some(&ChatOptions::default()))?,
        g => g,
    };
    if let Some(grammar) = grammar {
        request = request.with_constraint(text.constraint(&grammar)?)?;
    }
    let mut reader = harmony.then(|| AnswerReader::new(&text, &prompt, true, false));
    let mut stdout = std::io::stdout().lock();
    let mut write = |split: Split| {
        eprint!("{}", split.reasoning);
        // A closed stdout (e.g. `| head`) ends the output, not the program with a panic.
        let _ = stdout
            .write_all(split.text.as_bytes())
            .and_then(|()| stdout.flush());
    };
    let generation = generate_request(&mut pipeline, &text, 1, &request, |piece| {
        let split = match &mut reader {
            // Without tools, reading never fails.
            Some(r) => r.push(piece).unwrap_or_default(),
            None => Split {
                text: piece.to_string(),
                ..Split::default()
            },
        };
        write(split);
    })?;
    if let Some(r) = reader {
        write(r.finish(generation.finish == FinishReason::Stop)?.split);
    }
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout)?;
    if args.print_tokens {
        eprintln!("prompt: {prompt:?}");
        eprintln!("tokens: {:?}", generation.tokens);
    }
    Ok(())
}

/// Generates on a running pipeline through its head stage's data plane.
fn remote(args: &GenerateArgs, endpoint: &str) -> anyhow::Result<()> {
    use anyhow::Context;
    use shardplane_dataplane as dp;
    let shard = args.shard.as_deref().context("--shard")?;
    let (namespace, name) = shard
        .split_once('/')
        .with_context(|| format!("--shard {shard:?} is not namespace/name"))?;
    let token = dp::Token::from_file(args.token_file.as_deref().context("--token-file")?)
        .map_err(anyhow::Error::msg)?;
    let input = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(dp::ChatMessage {
                role: "system".into(),
                content: system.clone(),
                ..Default::default()
            });
        }
        messages.push(dp::ChatMessage {
            role: "user".into(),
            content: args.prompt.clone(),
            ..Default::default()
        });
        dp::generate_request::Input::Chat(dp::Conversation {
            messages,
            ..Default::default()
        })
    } else {
        dp::generate_request::Input::Prompt(args.prompt.clone())
    };
    let request = dp::GenerateRequest {
        shard: Some(dp::ShardRef {
            namespace: namespace.into(),
            name: name.into(),
        }),
        input: Some(input),
        sampling: Some(dp::Sampling {
            temperature: args.temperature,
            top_k: args.top_k.unwrap_or(0) as u32,
            top_p: args.top_p.unwrap_or(0.0),
            min_p: args.min_p.unwrap_or(0.0),
            repetition_penalty: args.repetition_penalty,
            seed: args.seed,
            max_tokens: args.max_tokens as u32,
            stop: args.stop.clone(),
            ..Default::default()
        }),
        resume: None,
        grammar: args.grammar()?.map(wire_grammar),
        tools: None,
    };
    let tls = args.remote_tls.load()?;
    tokio::runtime::Runtime::new()?.block_on(async {
        let mut client = dp::client(super::bench_remote::channel(endpoint, &tls)?, token);
        let mut stream = client
            .generate(request)
            .await
            .map_err(|s| anyhow::anyhow!("{endpoint}: {}", s.message()))?
            .into_inner();
        let mut stdout = std::io::stdout().lock();
        let mut tokens = Vec::new();
        while let Some(event) = stream
            .message()
            .await
            .map_err(|s| anyhow::anyhow!("{endpoint}: {}", s.message()))?
        {
            if let Some(dp::generate_response::Event::Delta(d)) = event.event {
                tokens.extend(d.tokens);
                let _ = stdout
                    .write_all(d.text.as_bytes())
                    .and_then(|()| stdout.flush());
            }
        }
        writeln!(stdout)?;
        if args.print_tokens {
            eprintln!("tokens: {tokens:?}");
        }
        Ok(())
    })
}

/// The data plane's form of an output grammar.
fn wire_grammar(g: Grammar) -> shardplane_dataplane::OutputGrammar {
    use shardplane_dataplane::output_grammar::Kind;
    shardplane_dataplane::OutputGrammar {
        kind: Some(match g {
            Grammar::JsonObject => Kind::JsonObject(true),
            Grammar::JsonSchema(schema) => Kind::JsonSchema(schema.to_string()),
            Grammar::Regex(rx) => Kind::Regex(rx),
            Grammar::Lark(lark) => Kind::Lark(lark),
        }),
    }
}
