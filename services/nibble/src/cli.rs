//! The command line, as clap types, and how parse errors are reported.
//!
//! Values are parsed into their final types here (a [`KvDtype`], a head dim that is a multiple of
//! 16, a finite positive global scale), so a bad flag is a usage error that names the flag. Every
//! usage error is reported as one `error: ...` line with exit status 2; only `--help` and
//! `--version` print more. The flags of the commands that run a model are in `cli/model.rs`.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::error::ErrorKind;
use clap::{Args, Parser, Subcommand};
use nibble_kvfmt::interchange::check_head_dim;
use nibble_kvfmt::{check_global_scale, KvDtype};

use crate::kv::Codec;
use crate::EXIT_USAGE;

mod model;

pub use model::{
    CalibrateArgs, EvalDtype, GenerateArgs, ModelArgs, PplArgs, QuantArgs, SamplingArgs,
    DEFAULT_MODEL,
};

/// nibble: a disaggregated prefill/decode LLM serving cluster with an NVFP4 KV cache.
#[derive(Debug, Parser)]
#[command(name = "nibble", version, about, arg_required_else_help = true)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// Top-level subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// KV-cache format tools: encode, decode, page layout.
    #[command(subcommand, arg_required_else_help = true)]
    Kv(KvCommand),
    /// Generate text from a prompt (here on the CPU or a GPU, or through a running cluster with
    /// --url), streaming it to stdout.
    #[command(arg_required_else_help = true)]
    Generate(GenerateArgs),
    /// Evaluate a model over a paged, quantized KV cache.
    #[command(subcommand, arg_required_else_help = true)]
    Eval(EvalCommand),
    /// Measure per-layer K/V amax on a text and write the calibration JSON (global scales).
    #[command(arg_required_else_help = true)]
    Calibrate(CalibrateArgs),
    /// Run a whole cluster on this machine: a router, a prefill and a decode worker on
    /// loopback, without etcd, on the default model (fetched on first use).
    Up(Box<crate::cluster::UpArgs>),
    /// Measure a running cluster under load (or a suite of clusters it starts itself): TTFT,
    /// ITL, throughput and goodput per load point, as JSON and plots.
    Bench(crate::bench::BenchArgs),
    /// Run the planner: leader-elected through etcd, it moves workers between prefill and
    /// decode in place to meet TTFT and ITL targets (`status`: the leader and its decisions).
    Planner(crate::planner::PlannerCommand),
    /// Run the router (as `nibble-router`): the Inference API over workers found in etcd.
    Router(nibble_router::cli::RouterArgs),
    /// Run a prefill worker (as `nibble-prefill`).
    Prefill(nibble_worker::WorkerArgs),
    /// Run a decode worker (as `nibble-decode`).
    Decode(nibble_worker::WorkerArgs),
}

/// `nibble eval ...`.
#[derive(Debug, Subcommand)]
pub enum EvalCommand {
    /// Perplexity and top-1 agreement with the f32 reference, over windows of a text.
    Ppl(PplArgs),
}

/// `nibble kv ...`.
#[derive(Debug, Subcommand)]
pub enum KvCommand {
    /// Encode little-endian f32 head vectors (IN) into the interchange layout (OUT).
    Encode(CodecArgs),
    /// Decode the interchange layout (IN) into little-endian f32 head vectors (OUT).
    Decode(CodecArgs),
    /// Print the byte accounting of one model geometry as one JSON object.
    Layout(LayoutArgs),
}

/// Flags and files of `nibble kv encode` and `nibble kv decode`.
#[derive(Debug, Args)]
pub struct CodecArgs {
    /// KV dtype: nvfp4, fp8 or bf16.
    #[arg(long, env = "NIBBLE_KV_DTYPE", value_parser = KvDtype::parse)]
    pub dtype: KvDtype,
    /// Values per head vector (D); a positive multiple of 16, at most 1024.
    #[arg(long, value_name = "D", value_parser = parse_head_dim)]
    pub head_dim: usize,
    /// FP32 global scale g, a dequantization multiplier (finite, > 0); not stored in the file, so
    /// decode needs the value encode used. Ignored by bf16.
    #[arg(
        long,
        value_name = "G",
        env = "NIBBLE_KV_GLOBAL_SCALE",
        default_value_t = 1.0,
        allow_negative_numbers = true,
        value_parser = parse_global_scale
    )]
    pub global_scale: f32,
    /// Input file: f32 values for encode, encoded vectors for decode.
    #[arg(value_name = "IN")]
    pub input: PathBuf,
    /// Output file; replaced only when the command succeeds.
    #[arg(value_name = "OUT")]
    pub output: PathBuf,
}

impl CodecArgs {
    /// The codec these flags select.
    pub fn codec(&self) -> crate::Result<Codec> {
        Codec::new(self.dtype, self.head_dim, self.global_scale)
    }
}

/// Flags of `nibble kv layout`.
#[derive(Debug, Args)]
pub struct LayoutArgs {
    /// Transformer layers.
    #[arg(long)]
    pub layers: usize,
    /// KV heads per layer.
    #[arg(long)]
    pub kv_heads: usize,
    /// Values per head vector (D); a positive multiple of 16, at most 1024.
    #[arg(long, value_name = "D", value_parser = parse_head_dim)]
    pub head_dim: usize,
    /// Tokens per page.
    #[arg(long, env = "NIBBLE_PAGE_SIZE", default_value_t = 16)]
    pub page_size: usize,
    /// KV dtype: nvfp4, fp8 or bf16.
    #[arg(long, env = "NIBBLE_KV_DTYPE", value_parser = KvDtype::parse)]
    pub dtype: KvDtype,
    /// Tokens of each sequence's BF16 recent window [default: 48 for nvfp4, rounded up to whole
    /// pages; 0 otherwise].
    #[arg(long, value_name = "TOKENS", env = "NIBBLE_KV_WINDOW")]
    pub kv_window: Option<usize>,
    /// Also report one sequence of this many tokens: its pages, bytes and tokens per GiB.
    #[arg(long, value_name = "TOKENS")]
    pub context: Option<usize>,
}

fn parse_head_dim(s: &str) -> Result<usize, String> {
    let head_dim = s
        .parse::<usize>()
        .map_err(|e| format!("not a whole number ({e})"))?;
    check_head_dim(head_dim).map_err(|e| e.to_string())?;
    Ok(head_dim)
}

fn parse_global_scale(s: &str) -> Result<f32, String> {
    let g = s
        .parse::<f32>()
        .map_err(|e| format!("not a number ({e})"))?;
    check_global_scale(g).map_err(|e| e.to_string())?;
    Ok(g)
}

/// Condenses a clap error into one `error: ...` line: its first paragraph, lines joined.
pub fn one_line(err: &clap::Error) -> String {
    let text = err.to_string();
    let line = text
        .lines()
        .map(str::trim)
        .skip_while(|l| l.is_empty())
        .take_while(|l| !l.is_empty())
        .collect::<Vec<_>>()
        .join(" ");
    let line = if line.starts_with("error:") {
        line
    } else {
        format!("error: {line}")
    };
    format!("{line} (see --help)")
}

/// Reports a failed parse: help and version go out as clap prints them; every other error becomes
/// one line on stderr and exit status [`EXIT_USAGE`].
pub fn report_parse_error(err: &clap::Error) -> ExitCode {
    match err.kind() {
        ErrorKind::DisplayHelp
        | ErrorKind::DisplayVersion
        | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
            // Nothing more useful to do if the terminal is gone.
            let _ = err.print();
            if err.use_stderr() {
                ExitCode::from(EXIT_USAGE)
            } else {
                ExitCode::SUCCESS
            }
        }
        _ => {
            eprintln!("{}", one_line(err));
            ExitCode::from(EXIT_USAGE)
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("nibble").chain(args.iter().copied()))
    }

    #[test]
    fn definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn parses_encode_with_defaults() {
        let cli = parse(&[
            "kv",
            "encode",
            "--dtype",
            "nvfp4",
            "--head-dim",
            "64",
            "a",
            "b",
        ])
        .expect("valid command line");
        let Command::Kv(KvCommand::Encode(args)) = cli.command else {
            panic!("parsed as {:?}", cli.command);
        };
        assert_eq!(args.dtype, KvDtype::Nvfp4);
        assert_eq!(args.head_dim, 64);
        assert_eq!(args.global_scale, 1.0);
        assert_eq!(args.input, PathBuf::from("a"));
        assert_eq!(args.output, PathBuf::from("b"));
    }

    #[test]
    fn layout_page_size_defaults_to_16() {
        let cli = parse(&[
            "kv",
            "layout",
            "--layers",
            "30",
            "--kv-heads",
            "3",
            "--head-dim",
            "64",
            "--dtype",
            "fp8",
        ])
        .expect("valid command line");
        let Command::Kv(KvCommand::Layout(args)) = cli.command else {
            panic!("parsed as {:?}", cli.command);
        };
        assert_eq!(args.page_size, 16);
        assert_eq!(args.dtype, KvDtype::Fp8);
    }

    #[test]
    fn bad_values_are_one_line_usage_errors() {
        let cases = [
            (
                &["--dtype", "fp16", "--head-dim", "64"][..],
                "unknown KV dtype \"fp16\"",
            ),
            (
                &["--dtype", "nvfp4", "--head-dim", "24"],
                "head dim must be a positive multiple of 16, got 24",
            ),
            (
                &[
                    "--dtype",
                    "nvfp4",
                    "--head-dim",
                    "64",
                    "--global-scale",
                    "0",
                ],
                "global scale must be finite and > 0, got 0",
            ),
            (
                &["--dtype", "nvfp4", "--head-dim", "x"],
                "not a whole number",
            ),
        ];
        for (flags, expected) in cases {
            let mut args = vec!["kv", "encode"];
            args.extend_from_slice(flags);
            args.extend_from_slice(&["in", "out"]);
            let err = parse(&args).expect_err("must be rejected");
            assert_eq!(err.exit_code(), i32::from(EXIT_USAGE));
            let line = one_line(&err);
            assert!(line.starts_with("error: "), "{line}");
            assert!(!line.contains('\n'), "{line}");
            assert!(
                line.contains(expected),
                "{line:?} should mention {expected:?}"
            );
        }
    }

    #[test]
    fn missing_arguments_are_listed_on_one_line() {
        let err = parse(&["kv", "encode", "--dtype", "fp8", "in", "out"]).expect_err("no head dim");
        let line = one_line(&err);
        assert!(line.contains("--head-dim <D>"), "{line}");
        assert!(!line.contains('\n'), "{line}");
    }
}
