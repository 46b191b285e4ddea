//! Fuzz targets for the KV byte formats a worker receives from elsewhere (see
//! `nibble_testkit::fuzz`): the interchange decoder and the check of received pages take any
//! bytes, with any geometry and global scale the input picks, and answer with values or an
//! error, never a panic. Seeds: encodings of real values in each dtype.

use nibble_kvfmt::{interchange, KvDtype, PageLayout, SequencePages, WindowLayout};
use nibble_testkit::fuzz::{mutate, ITERATIONS};

const DTYPES: [KvDtype; 3] = [KvDtype::Nvfp4, KvDtype::Fp8, KvDtype::Bf16];

/// The first byte picks the dtype, the next two the head dim and the global scale; the rest
/// edits the seed of that dtype.
fn split(input: &[u8]) -> (KvDtype, usize, f32, &[u8]) {
    let byte = |i: usize| input.get(i).copied().unwrap_or(0);
    let dtype = DTYPES[usize::from(byte(0)) % DTYPES.len()];
    // Mostly valid head dims (multiples of 16), sometimes not.
    let head_dim = match byte(1) % 8 {
        0 => usize::from(byte(1)),
        n => 16 * usize::from(n),
    };
    let g = match byte(2) % 6 {
        0 => f32::NAN,
        1 => 0.0,
        2 => -1.0,
        n => f32::from(n) / 7.0,
    };
    (dtype, head_dim, g, input.get(3..).unwrap_or_default())
}

#[test]
fn interchange_bytes_decode_or_are_refused() {
    let values: Vec<f32> = (0..256)
        .map(|i| ((i * 37) % 101) as f32 / 9.0 - 5.0)
        .collect();
    let seeds: Vec<Vec<u8>> = DTYPES
        .iter()
        .map(|d| interchange::encode(*d, 64, 1.0 / 6.0, &values).unwrap())
        .collect();
    bolero::check!()
        .with_iterations(ITERATIONS)
        .for_each(|input: &[u8]| {
            let (dtype, head_dim, g, rest) = split(input);
            let seed = &seeds[DTYPES.iter().position(|d| *d == dtype).unwrap()];
            let bytes = mutate(&[seed], rest);
            if let Ok(decoded) = interchange::decode(dtype, head_dim, g, &bytes) {
                assert_eq!(decoded.len() % head_dim, 0);
            }
        });
}

#[test]
fn received_pages_are_checked_without_panicking() {
    bolero::check!()
        .with_iterations(ITERATIONS)
        .for_each(|input: &[u8]| {
            let (dtype, head_dim, _, rest) = split(input);
            let Ok(layout) = PageLayout::new(2, 2, head_dim, 16, dtype) else {
                return;
            };
            let window_tokens = 16 * usize::from(rest.first().copied().unwrap_or(0) % 3);
            let Ok(window) = WindowLayout::new(&layout, window_tokens) else {
                return;
            };
            let tokens = usize::from(rest.get(1).copied().unwrap_or(1));
            let seq = SequencePages::new(layout, window, tokens);
            // A zeroed page is valid in every dtype; the input edits it.
            let page = vec![0u8; layout.page_bytes()];
            let bytes = mutate(&[&page], rest.get(2..).unwrap_or_default());
            for index in 0..seq.pages() + 1 {
                let _ = seq.check(index, &bytes);
            }
        });
}
