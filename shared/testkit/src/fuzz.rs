//! Fuzzing the readers of untrusted bytes (model files, KV pages, request bodies and messages)
//! with bolero: under `cargo test` each target runs its committed corpus and a bounded number of
//! random inputs (`BOLERO_RANDOM_ITERATIONS` overrides it); `cargo bolero test` runs the same
//! targets under libFuzzer for as long as asked. A crash found either way is a file to add to
//! the corpus, where every later test run replays it.
//!
//! Random bytes rarely get past a format's first check, so each input is read as edits of one
//! of the target's valid seeds ([`mutate`]): the fuzzer explores the neighbourhood of real
//! files, where the interesting length and offset fields are.

/// How many random inputs a fuzz target tries under `cargo test`.
pub const ITERATIONS: usize = 2_000;

/// `seeds[input[0]]` changed as the rest of `input` says, four bytes an edit: an offset (two
/// bytes, scaled to the seed), an operation (overwrite, insert, delete, or cut the input there)
/// and a value. An input of fewer than five bytes is the seed itself; no seeds, the input itself.
pub fn mutate(seeds: &[&[u8]], input: &[u8]) -> Vec<u8> {
    let Some((&pick, edits)) = input.split_first() else {
        return seeds.first().map(|s| s.to_vec()).unwrap_or_default();
    };
    if seeds.is_empty() {
        return input.to_vec();
    }
    let mut out = seeds[usize::from(pick) % seeds.len()].to_vec();
    for edit in edits.chunks_exact(4) {
        let at = usize::from(u16::from_le_bytes([edit[0], edit[1]]));
        let at = match out.len() {
            0 => 0,
            n => at * n / usize::from(u16::MAX) % (n + 1),
        };
        match edit[2] % 4 {
            0 if at < out.len() => out[at] = edit[3],
            1 => out.insert(at.min(out.len()), edit[3]),
            2 if at < out.len() => {
                out.remove(at);
            }
            3 => out.truncate(at),
            _ => {}
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::mutate;

    #[test]
    fn inputs_edit_a_chosen_seed() {
        let seeds: [&[u8]; 2] = [b"abcd", b"wxyz"];
        assert_eq!(mutate(&seeds, &[]), b"abcd");
        assert_eq!(mutate(&seeds, &[1]), b"wxyz");
        // Overwrite the first byte of the second seed.
        assert_eq!(mutate(&seeds, &[1, 0, 0, 0, b'!']), b"!xyz");
        // Cut at the end: nothing changes; cut at 0: empty.
        assert_eq!(mutate(&seeds, &[0, 255, 255, 3, 0]), b"abcd");
        assert_eq!(mutate(&seeds, &[0, 0, 0, 3, 0]), b"");
        assert_eq!(mutate(&[], b"raw"), b"raw");
    }
}
