//! Flags of the commands that run a model: `generate`, `eval ppl` and `calibrate`.
//!
//! Values are parsed into their final types here (a [`KvDtype`] or [`EvalDtype`], an
//! [`EvalPath`], counts that must be positive), so a bad flag is a one-line usage error naming
//! the flag. Sampling values are only given types here; their ranges are the engine's to decide
//! ([`SamplingParams::validate`]), and the commands check them before loading the model.

use std::num::NonZeroUsize;
use std::path::PathBuf;

use clap::Args;
use nibble_cuda::Device;
use nibble_engine::eval::EvalPath;
use nibble_engine::paged::WorkDtype;
use nibble_engine::sampling::SamplingParams;
use nibble_kvfmt::{KvDtype, ScaleRule};

/// The model `--model` names when neither the flag nor `NIBBLE_MODEL` is given, relative to the
/// current directory; `scripts/fetch-model.sh` puts it there.
pub const DEFAULT_MODEL: &str = "models/SmolLM2-135M-Instruct.Q4_1.gguf";

/// Which model to load and on how many threads.
#[derive(Debug, Clone, Args)]
pub struct ModelArgs {
    /// Model: a GGUF file or a Hugging Face model directory.
    #[arg(long, value_name = "PATH", env = "NIBBLE_MODEL", default_value = DEFAULT_MODEL)]
    pub model: PathBuf,
    /// CPU threads [default: every available core].
    #[arg(long, value_name = "N", env = "NIBBLE_THREADS", value_parser = parse_positive)]
    pub threads: Option<usize>,
    /// Where the model runs: cpu, cuda (GPU 0; an error if it cannot start) or auto (CUDA
    /// when a GPU is found, else the CPU).
    #[arg(
        long,
        value_name = "DEVICE",
        env = "NIBBLE_DEVICE",
        default_value = "auto"
    )]
    pub device: Device,
}

impl ModelArgs {
    /// `--threads`, or the available parallelism (1 if unknown).
    pub fn threads(&self) -> usize {
        self.threads
            .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, NonZeroUsize::get))
    }
}

/// How quantized K/V is stored, beyond its dtype.
#[derive(Debug, Clone, Args)]
pub struct QuantArgs {
    /// Calibration JSON (from `nibble calibrate`): per-layer K/V global scales and K's channel
    /// amax; without it every scale is the dtype's uncalibrated one and K is not smoothed.
    #[arg(long, value_name = "FILE", env = "NIBBLE_CALIBRATION")]
    pub calibration: Option<PathBuf>,
    /// Do not smooth K per channel. With a --calibration that measured K's channels (every
    /// file `nibble calibrate` writes), K's channels are scaled to one amax before they are
    /// cached and Q's by the reciprocals, so attention scores are unchanged and NVFP4's shared
    /// block scales fit every channel (docs/ACCURACY.md).
    #[arg(long, env = "NIBBLE_NO_SMOOTH_K")]
    pub no_smooth_k: bool,
    /// Round K to the nearest NVFP4 codes. With a --calibration that measured the queries'
    /// second moment (files `nibble calibrate` writes from this version on), an nvfp4 cache
    /// chooses each key's codes for the queries that will read it instead, which leaves less
    /// error in the attention scores (docs/ACCURACY.md, "K's codes chosen for the queries").
    #[arg(long, env = "NIBBLE_NO_K_CODES")]
    pub no_k_codes: bool,
    /// Rotate K/V head vectors (and Q) by the normalized Hadamard matrix before quantizing.
    #[arg(long, env = "NIBBLE_HADAMARD")]
    pub hadamard: bool,
    /// How NVFP4 block scales are chosen on write: mse (of the E4M3 codes near amax/6, the one
    /// with the least squared error over the block; the default) or amax (amax/6, the bytes other
    /// NVFP4 implementations write). Readers decode both alike.
    #[arg(long, value_name = "RULE", env = "NIBBLE_KV_SCALE_RULE", default_value = "mse",
          value_parser = ScaleRule::parse)]
    pub scale_rule: ScaleRule,
    /// Tokens per KV page.
    #[arg(long, value_name = "N", env = "NIBBLE_PAGE_SIZE", default_value_t = 16,
          value_parser = parse_positive)]
    pub page_size: usize,
    /// Tokens of each sequence's most recent K/V also kept in BF16, which attention reads
    /// instead of their pages; a multiple of --page-size, 0 for none [default: 48 for an nvfp4
    /// cache, rounded up to whole pages; 0 otherwise].
    #[arg(long, value_name = "TOKENS", env = "NIBBLE_KV_WINDOW")]
    pub kv_window: Option<usize>,
    /// The dtype prefill and extend attention hold K/V in: fp8 or bf16 (the new tokens in it,
    /// cached ones dequantized into it; bf16 is the only one for a bf16 cache) [default: bf16,
    /// the more accurate, and on Hopper the faster].
    #[arg(long, value_name = "DTYPE", env = "NIBBLE_PREFILL_WORK", value_parser = WorkDtype::parse)]
    pub prefill_work: Option<WorkDtype>,
}

/// Flags of `nibble generate`.
#[derive(Debug, Clone, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// KV cache dtype: bf16, fp8 or nvfp4.
    #[arg(long, value_name = "DTYPE", env = "NIBBLE_KV_DTYPE", default_value = "nvfp4",
          value_parser = KvDtype::parse)]
    pub kv_dtype: KvDtype,
    #[command(flatten)]
    pub quant: QuantArgs,
    /// MiB of KV pages to allocate (the flag every nibble command takes for this).
    #[arg(long, value_name = "MIB", env = "NIBBLE_KV_BUDGET_MIB", default_value_t = 256,
          value_parser = parse_positive, alias = "kv-budget-mb")]
    pub kv_budget_mib: usize,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    /// Render the prompt as one user message with the model's chat template (and the header of
    /// the assistant's turn).
    #[arg(long)]
    pub chat: bool,
    /// A system message before the user's (needs --chat).
    #[arg(long, value_name = "TEXT", requires = "chat")]
    pub system: Option<String>,
    /// Send the request to the router of a running cluster at this address (`nibble up`
    /// prints it) instead of running the model here; the model and KV flags are then the
    /// cluster's, not these.
    #[arg(long, value_name = "ADDR", env = "NIBBLE_URL")]
    pub url: Option<String>,
    /// With --url: the PEM CA the router's certificate is verified against; the address is
    /// then dialed over TLS (`https://`).
    #[arg(long, value_name = "PEM", env = "NIBBLE_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// With --url: the router's API key, sent as `authorization: Bearer`.
    #[arg(long, env = "NIBBLE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The prompt.
    #[arg(value_name = "PROMPT")]
    pub prompt: String,
}

/// Sampling flags of `nibble generate`; defaults are [`SamplingParams::default`]'s.
#[derive(Debug, Clone, Args)]
pub struct SamplingArgs {
    /// Tokens to generate at most (1 to 32768).
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub max_tokens: u32,
    /// 0 is greedy; otherwise logits are divided by it (0 to 2).
    #[arg(
        long,
        value_name = "T",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub temperature: f32,
    /// Keep only the K most likely tokens [default: all].
    #[arg(long, value_name = "K")]
    pub top_k: Option<u32>,
    /// Keep the smallest set of tokens whose probability reaches P, in (0, 1].
    #[arg(
        long,
        value_name = "P",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub top_p: f32,
    /// Drop tokens less likely than P times the most likely one, in [0, 1).
    #[arg(
        long,
        value_name = "P",
        default_value_t = 0.0,
        allow_negative_numbers = true
    )]
    pub min_p: f32,
    /// Seed of the random state [default: drawn from the OS].
    #[arg(long, value_name = "N")]
    pub seed: Option<u64>,
    /// > 1 discourages tokens already seen (prompt and output), < 1 encourages them; in (0, 10].
    #[arg(
        long,
        value_name = "R",
        default_value_t = 1.0,
        allow_negative_numbers = true
    )]
    pub repetition_penalty: f32,
    /// A string that ends generation (the text stops before it); repeatable.
    #[arg(long, value_name = "TEXT")]
    pub stop: Vec<String>,
    /// A token id that ends generation, besides the model's end of sequence; repeatable.
    #[arg(long, value_name = "ID")]
    pub stop_token_id: Vec<u32>,
    /// Print each generated token's log-probability (under the model's own distribution) as
    /// one JSON line on stderr after the summary.
    #[arg(long)]
    pub logprobs: bool,
}

impl SamplingArgs {
    /// The engine's parameters, checked.
    pub fn params(&self) -> Result<SamplingParams, nibble_engine::sampling::InvalidParam> {
        // Field by field onto a base, so fields the engine adds keep their defaults.
        let mut params = SamplingParams::greedy(self.max_tokens);
        params.temperature = self.temperature;
        params.top_k = self.top_k;
        params.top_p = self.top_p;
        params.min_p = self.min_p;
        params.repetition_penalty = self.repetition_penalty;
        params.seed = self.seed;
        params.stop_token_ids = self.stop_token_id.clone();
        params.stop = self.stop.clone();
        params.logprobs = self.logprobs;
        params.validate()?;
        Ok(params)
    }
}

/// The cache `nibble eval ppl` scores through: a quantized dtype, or the f32 reference itself.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EvalDtype {
    /// Contiguous f32 K/V, no pages, no quantization: the reference alone.
    F32,
    /// Paged K/V in this dtype.
    Kv(KvDtype),
}

impl EvalDtype {
    /// The name as the flag spells it.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Kv(dtype) => dtype.name(),
        }
    }
}

/// Flags of `nibble eval ppl`.
#[derive(Debug, Clone, Args)]
pub struct PplArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// KV cache dtype: bf16, fp8, nvfp4, or f32 for the full-precision reference alone.
    #[arg(long, value_name = "DTYPE", env = "NIBBLE_KV_DTYPE", value_parser = parse_eval_dtype)]
    pub kv_dtype: EvalDtype,
    #[command(flatten)]
    pub quant: QuantArgs,
    /// UTF-8 text to score, tokenized whole without a BOS token.
    #[arg(long, value_name = "FILE")]
    pub text: PathBuf,
    /// Tokens per window (at least 2); tokens 1..N-1 are predicted from their prefixes.
    #[arg(long, value_name = "N", value_parser = parse_window)]
    pub window: usize,
    /// Consecutive, non-overlapping windows from the start of the text.
    #[arg(long, value_name = "K", default_value_t = 1, value_parser = parse_positive)]
    pub windows: usize,
    /// Attention path: prefill (one initial prefill), extend (64-token chunks), blocks (the
    /// serving engine's 256-token prompt blocks) or decode (one token at a time, attention
    /// reading the quantized pages).
    #[arg(long, value_name = "PATH", default_value = "decode", value_parser = parse_path)]
    pub path: EvalPath,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    pub json: bool,
}

/// Flags of `nibble calibrate`.
#[derive(Debug, Clone, Args)]
pub struct CalibrateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// UTF-8 sample text, tokenized whole without a BOS token.
    #[arg(long, value_name = "FILE")]
    pub text: PathBuf,
    /// Tokens per forward pass: the text runs as independent windows of this many tokens.
    #[arg(long, value_name = "N", default_value_t = 512, value_parser = parse_positive)]
    pub window: usize,
    /// Use at most the first N tokens of the text [default: all of them].
    #[arg(long, value_name = "N", value_parser = parse_positive)]
    pub max_tokens: Option<usize>,
    /// Record that an nvfp4 cache of this model needs a recent window of N tokens: a cache
    /// given this file with --calibration then gets it unless --kv-window names another
    /// (Qwen2.5-Coder-0.5B needs 128 where SmolLM2 meets its target at the default 48:
    /// docs/ACCURACY.md).
    #[arg(long, value_name = "N")]
    pub nvfp4_window: Option<usize>,
    /// Output JSON; replaced only when the command succeeds.
    #[arg(value_name = "OUT.json")]
    pub output: PathBuf,
}

fn parse_eval_dtype(s: &str) -> Result<EvalDtype, String> {
    if s.eq_ignore_ascii_case("f32") {
        return Ok(EvalDtype::F32);
    }
    KvDtype::parse(s)
        .map(EvalDtype::Kv)
        .map_err(|_| format!("unknown KV dtype {s:?}: expected bf16, fp8, nvfp4 or f32"))
}

fn parse_path(s: &str) -> Result<EvalPath, String> {
    s.parse::<EvalPath>()
        .map_err(|_| format!("unknown path {s:?}: expected prefill, extend, blocks or decode"))
}

fn parse_positive(s: &str) -> Result<usize, String> {
    let n = s
        .parse::<usize>()
        .map_err(|e| format!("not a whole number ({e})"))?;
    if n == 0 {
        return Err("must be at least 1, got 0".into());
    }
    Ok(n)
}

fn parse_window(s: &str) -> Result<usize, String> {
    let n = s
        .parse::<usize>()
        .map_err(|e| format!("not a whole number ({e})"))?;
    if n < 2 {
        return Err(format!("a window must be at least 2 tokens, got {n}"));
    }
    Ok(n)
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;
    use crate::cli::{Cli, Command, EvalCommand};

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("nibble").chain(args.iter().copied()))
    }

    #[test]
    fn generate_kv_budget_is_mib_like_every_command() {
        for flag in ["--kv-budget-mib", "--kv-budget-mb"] {
            let Command::Generate(args) = parse(&["generate", flag, "64", "hi"])
                .expect("valid")
                .command
            else {
                panic!("not generate");
            };
            assert_eq!(args.kv_budget_mib, 64, "{flag}");
        }
        assert!(parse(&["generate", "--kv-budget-mib", "0", "hi"]).is_err());
    }

    #[test]
    fn generate_defaults() {
        let Command::Generate(args) = parse(&["generate", "hi"]).expect("valid").command else {
            panic!("not generate");
        };
        assert_eq!(args.kv_dtype, KvDtype::Nvfp4);
        assert_eq!(args.quant.page_size, 16);
        assert_eq!(args.kv_budget_mib, 256);
        assert!(!args.chat && args.system.is_none());
        assert_eq!(
            args.sampling.params().expect("valid"),
            SamplingParams::default()
        );
        assert_eq!(args.prompt, "hi");
    }

    #[test]
    fn sampling_flags_map_onto_params() {
        let cli = parse(&[
            "generate",
            "--temperature",
            "0",
            "--top-k",
            "5",
            "--top-p",
            "0.9",
            "--min-p",
            "0.05",
            "--seed",
            "7",
            "--repetition-penalty",
            "1.1",
            "--max-tokens",
            "9",
            "--stop",
            "a",
            "--stop",
            "b",
            "--stop-token-id",
            "3",
            "--stop-token-id",
            "4",
            "--logprobs",
            "--chat",
            "--system",
            "be brief",
            "hi",
        ])
        .expect("valid");
        let Command::Generate(args) = cli.command else {
            panic!("not generate");
        };
        let p = args.sampling.params().expect("valid");
        assert_eq!(p.temperature, 0.0);
        assert_eq!(p.top_k, Some(5));
        assert_eq!((p.top_p, p.min_p, p.repetition_penalty), (0.9, 0.05, 1.1));
        assert_eq!((p.seed, p.max_tokens), (Some(7), 9));
        assert_eq!(p.stop, ["a", "b"]);
        assert_eq!(p.stop_token_ids, [3, 4]);
        assert!(p.logprobs);
        assert_eq!(args.system.as_deref(), Some("be brief"));
    }

    #[test]
    fn out_of_range_sampling_is_named() {
        let Command::Generate(args) = parse(&["generate", "--min-p", "1", "x"])
            .expect("parses")
            .command
        else {
            panic!("not generate");
        };
        let err = args.sampling.params().expect_err("min_p 1 is out of range");
        assert_eq!(err.to_string(), "min_p must be in [0, 1), got 1");
    }

    #[test]
    fn eval_ppl_flags() {
        let cli = parse(&[
            "eval",
            "ppl",
            "--kv-dtype",
            "F32",
            "--text",
            "t.txt",
            "--window",
            "2",
            "--json",
        ])
        .expect("valid");
        let Command::Eval(EvalCommand::Ppl(args)) = cli.command else {
            panic!("not eval ppl");
        };
        assert_eq!(args.kv_dtype, EvalDtype::F32);
        assert_eq!((args.window, args.windows), (2, 1));
        assert_eq!(args.path, EvalPath::Decode);
        assert!(args.json);
        for (flags, expected) in [
            (
                &["--window", "1"][..],
                "a window must be at least 2 tokens, got 1",
            ),
            (
                &["--window", "64", "--windows", "0"],
                "must be at least 1, got 0",
            ),
            (&["--window", "64", "--path", "up"], "unknown path \"up\""),
            (
                &["--window", "64", "--threads", "0"],
                "must be at least 1, got 0",
            ),
        ] {
            let mut all = vec!["eval", "ppl", "--kv-dtype", "fp8", "--text", "t"];
            all.extend_from_slice(flags);
            let err = parse(&all).expect_err("rejected");
            let line = crate::cli::one_line(&err);
            assert!(line.contains(expected), "{line}");
        }
        let err = parse(&[
            "eval",
            "ppl",
            "--kv-dtype",
            "int8",
            "--text",
            "t",
            "--window",
            "8",
        ])
        .expect_err("unknown dtype");
        assert!(
            crate::cli::one_line(&err).contains("expected bf16, fp8, nvfp4 or f32"),
            "{err}"
        );
    }

    #[test]
    fn calibrate_flags() {
        let cli = parse(&["calibrate", "--text", "t.txt", "out.json"]).expect("valid");
        let Command::Calibrate(args) = cli.command else {
            panic!("not calibrate");
        };
        assert_eq!(args.window, 512);
        assert_eq!(args.max_tokens, None);
        assert_eq!(args.output, PathBuf::from("out.json"));
        assert_eq!(args.model.model, PathBuf::from(DEFAULT_MODEL));
    }
}
