//! Prints the token ids of a text file under a GGUF model's tokenizer, as a JSON array.
//!
//! `cargo run --release -p nibble-engine --example tokenize -- MODEL.gguf TEXT_FILE [max_tokens]`

use nibble_engine::{gguf::GgufFile, Tokenizer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let (Some(model), Some(text)) = (args.get(1), args.get(2)) else {
        return Err("usage: tokenize MODEL.gguf TEXT_FILE [max_tokens]".into());
    };
    let max: usize = args.get(3).map_or(Ok(usize::MAX), |s| s.parse())?;
    let tok = Tokenizer::from_gguf(&GgufFile::open(model)?)?;
    let ids = tok.encode(&std::fs::read_to_string(text)?, false)?;
    let ids = &ids[..ids.len().min(max)];
    println!("{}", serde_json::to_string(ids)?);
    Ok(())
}
