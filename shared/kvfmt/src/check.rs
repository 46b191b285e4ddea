//! Checking pages that arrive from elsewhere (a transfer) before anything reads them: the bytes
//! no writer produces.
//!
//! Every writer (quantize-on-write, the window store, on the CPU and on a GPU) produces only:
//!
//! * NVFP4 block scales `0x00..=0x7E`: a scale is `E4M3_RNE_SAT(amax / 6g)` (or, under the mse
//!   rule, a code near it, never above `0x7E`) of a non-negative amax, so its sign bit is never
//!   set, and `0x7F` is E4M3's NaN. E2M1 elements are all finite: nothing to check.
//! * FP8 elements other than `0x7F` and `0xFF`, E4M3's NaN codes (encoding saturates at ±448).
//! * BF16 values of finite numbers, in a bf16 page or in the recent window (whatever the pool's
//!   dtype): no all-ones exponent (NaN or infinity).
//!
//! Only the bytes a reader will attend to are checked, which are exactly the bytes a correct
//! sender wrote: in each prompt page, the tokens of the sequence (past its last token, a
//! sender's last page holds whatever that page held before, which is legitimate, is never
//! attended to, and is overwritten as the receiver decodes); in the window pages, the ring slots
//! of the sequence's last `W` tokens (before the ring has wrapped the others are stale), not the
//! bytes past a page's last unit.
//!
//! The scans are branch-free maximum reductions the compiler vectorizes, over 1/9 of an NVFP4
//! page's bytes (its scales); only a failing page is scanned again to name the first bad byte.

use crate::{KvDtype, KvPart, PageLayout, WindowLayout};

/// The sequence a set of received pages belongs to: its page layout, its window, and how many
/// tokens it holds. Its pages are `prompt_pages()` pages of the prompt then `window.pages()`
/// window pages, as a hand-off lists them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequencePages {
    layout: PageLayout,
    window: WindowLayout,
    tokens: usize,
}

/// Which check a byte failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// An NVFP4 block-scale byte above `0x7E` (NaN, or a negative scale).
    Nvfp4Scale(u8),
    /// An FP8 element byte `0x7F` or `0xFF` (NaN).
    Fp8Element(u8),
    /// A BF16 element of a bf16 page that is NaN or infinite.
    Bf16Element(u16),
    /// A BF16 value of the recent window that is NaN or infinite.
    WindowValue(u16),
    /// The page is not `page_bytes` long.
    Length { expected: usize, actual: usize },
    /// The page index is past the sequence's pages.
    Index { pages: usize },
}

/// Where in the model a bad byte sits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Site {
    pub layer: usize,
    pub part: KvPart,
    pub head: usize,
    /// The token within the page, or the position in the sequence for a window value.
    pub token: usize,
}

/// Why a received page is refused: which check failed, at which byte of the page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{}", describe(self))]
pub struct PageFault {
    pub check: Check,
    /// Byte offset within the page.
    pub offset: usize,
    /// The layer, K or V, head and token of that byte (not for length and index faults).
    pub site: Option<Site>,
}

fn describe(f: &PageFault) -> String {
    let site = match f.site {
        Some(s) => {
            let part = if s.part == KvPart::K { "K" } else { "V" };
            let token = match f.check {
                Check::WindowValue(_) => "position",
                _ => "token",
            };
            format!(
                " (layer {} {part}, head {}, {token} {})",
                s.layer, s.head, s.token
            )
        }
        None => String::new(),
    };
    let at = format!("at byte {}{site}", f.offset);
    let bf16_kind = |bits: u16| {
        if bits & 0x007F == 0 {
            "infinite"
        } else {
            "NaN"
        }
    };
    match f.check {
        Check::Nvfp4Scale(code) => format!(
            "NVFP4 block scale 0x{code:02x} {at} is {}: scales are 0x00..=0x7e",
            if code & 0x7F == 0x7F {
                "NaN"
            } else {
                "negative"
            }
        ),
        Check::Fp8Element(code) => format!("FP8 element 0x{code:02x} {at} is NaN"),
        Check::Bf16Element(bits) => {
            format!("BF16 element 0x{bits:04x} {at} is {}", bf16_kind(bits))
        }
        Check::WindowValue(bits) => format!(
            "recent-window BF16 value 0x{bits:04x} {at} is {}",
            bf16_kind(bits)
        ),
        Check::Length { expected, actual } => {
            format!("the page is {actual} bytes, not {expected}")
        }
        Check::Index { pages } => format!("the sequence has {pages} pages"),
    }
}

impl SequencePages {
    /// The pages of a sequence of `tokens` tokens over pages of `layout` with `window`.
    pub fn new(layout: PageLayout, window: WindowLayout, tokens: usize) -> Self {
        Self {
            layout,
            window,
            tokens,
        }
    }

    /// Pages of the prompt: `ceil(tokens / page_size)`.
    pub fn prompt_pages(&self) -> usize {
        self.tokens.div_ceil(self.layout.page_size())
    }

    /// Every page: the prompt's, then the window's.
    pub fn pages(&self) -> usize {
        self.prompt_pages() + self.window.pages()
    }

    /// Checks page `index` of the sequence (`page` its bytes): `Ok` when every byte a reader
    /// attends to is one a writer produces, else the first bad one.
    pub fn check(&self, index: usize, page: &[u8]) -> Result<(), PageFault> {
        let expected = self.layout.page_bytes();
        if page.len() != expected {
            return Err(PageFault {
                check: Check::Length {
                    expected,
                    actual: page.len(),
                },
                offset: 0,
                site: None,
            });
        }
        let prompt = self.prompt_pages();
        if index < prompt {
            let tokens =
                (self.tokens - index * self.layout.page_size()).min(self.layout.page_size());
            self.check_prompt_page(page, tokens)
        } else if index < self.pages() {
            self.check_window_page(index - prompt, page)
        } else {
            Err(PageFault {
                check: Check::Index {
                    pages: self.pages(),
                },
                offset: 0,
                site: None,
            })
        }
    }

    /// The first `tokens` tokens of every (layer, part, head) of a prompt page.
    fn check_prompt_page(&self, page: &[u8], tokens: usize) -> Result<(), PageFault> {
        let l = &self.layout;
        let (p, heads) = (l.page_size(), l.kv_heads());
        let kind = match l.dtype() {
            KvDtype::Nvfp4 => Kind::Scale,
            KvDtype::Fp8 => Kind::Fp8,
            KvDtype::Bf16 => Kind::Bf16,
        };
        // The bytes of one token of one head, and where a head's tokens start in a part.
        let (per_token, region) = match kind {
            Kind::Scale => (l.scale_bytes(), heads * p * l.data_bytes()),
            _ => (l.data_bytes(), 0),
        };
        for part_index in 0..2 * l.layers() {
            let base = part_index * l.part_bytes() + region;
            // A full page's heads are one contiguous run; a partial page's, one run per head.
            let runs = if tokens == p { 1 } else { heads };
            let run = if tokens == p { heads * p } else { tokens } * per_token;
            for h in 0..runs {
                let start = base + h * p * per_token;
                let bytes = &page[start..start + run];
                if !kind.clean(bytes) {
                    let (at, check) = kind.first_bad(bytes).expect("a dirty run has a bad byte");
                    return Err(self.prompt_fault(start + at, check));
                }
            }
        }
        Ok(())
    }

    fn prompt_fault(&self, offset: usize, check: Check) -> PageFault {
        let l = &self.layout;
        let part_index = offset / l.part_bytes();
        let within = offset % l.part_bytes();
        let data = l.kv_heads() * l.page_size() * l.data_bytes();
        // Data is [head][token][data bytes], scales after it [head][token][scale bytes].
        let vector = if within < data {
            within / l.data_bytes()
        } else {
            (within - data) / l.scale_bytes()
        };
        PageFault {
            check,
            offset,
            site: Some(Site {
                layer: part_index / 2,
                part: if part_index.is_multiple_of(2) {
                    KvPart::K
                } else {
                    KvPart::V
                },
                head: vector / l.page_size(),
                token: vector % l.page_size(),
            }),
        }
    }

    /// The live units of window page `w`: every unit once the ring has wrapped, else the slots
    /// of the tokens so far.
    fn check_window_page(&self, w: usize, page: &[u8]) -> Result<(), PageFault> {
        let win = &self.window;
        let (ring, unit) = (win.tokens(), win.unit_bytes());
        let per_page = win.units_per_page();
        let first = w * per_page;
        let last = (first + per_page).min(self.layout.layers() * ring);
        let live = self.tokens.min(ring);
        // Runs of live units: all of them when every slot is live, else a run per layer.
        let mut u = first;
        while u < last {
            let slot = u % ring;
            let end = if live == ring {
                last
            } else if slot >= live {
                u = (u / ring + 1) * ring;
                continue;
            } else {
                (u - slot + live).min(last)
            };
            let start = (u - first) * unit;
            let bytes = &page[start..(end - first) * unit];
            if !Kind::Bf16.clean(bytes) {
                let (at, check) = Kind::Bf16.first_bad(bytes).expect("a dirty run");
                let Check::Bf16Element(bits) = check else {
                    unreachable!("BF16 runs fail BF16 checks")
                };
                return Err(self.window_fault(first, start + at, bits));
            }
            u = end;
        }
        Ok(())
    }

    fn window_fault(&self, first_unit: usize, offset: usize, bits: u16) -> PageFault {
        let win = &self.window;
        let (ring, unit) = (win.tokens(), win.unit_bytes());
        let u = first_unit + offset / unit;
        let (layer, slot) = (u / ring, u % ring);
        let vector = (offset % unit) / (2 * self.layout.head_dim());
        let heads = self.layout.kv_heads();
        // The position of the sequence's last `ring` tokens that sits in `slot`.
        let end = self.tokens;
        let position = (end.saturating_sub(ring)..end)
            .find(|t| t % ring == slot)
            .unwrap_or(slot);
        PageFault {
            check: Check::WindowValue(bits),
            offset,
            site: Some(Site {
                layer,
                part: if vector < heads { KvPart::K } else { KvPart::V },
                head: vector % heads,
                token: position,
            }),
        }
    }
}

/// What the bytes of a run are.
#[derive(Clone, Copy)]
enum Kind {
    /// NVFP4 block scales.
    Scale,
    /// FP8 elements.
    Fp8,
    /// BF16 values, little-endian.
    Bf16,
}

impl Kind {
    /// Whether every value of `bytes` passes: one maximum reduction.
    fn clean(self, bytes: &[u8]) -> bool {
        match self {
            Kind::Scale => bytes.iter().fold(0u8, |m, &b| m.max(b)) <= 0x7E,
            // 0x7F and 0xFF are the bytes whose low seven bits are all set.
            Kind::Fp8 => bytes.iter().fold(0u8, |m, &b| m.max(b | 0x80)) != 0xFF,
            // NaN and infinity are the values whose eight exponent bits are all set.
            Kind::Bf16 => {
                bytes.chunks_exact(2).fold(0u16, |m, c| {
                    m.max(u16::from_le_bytes([c[0], c[1]]) | 0x807F)
                }) != 0xFFFF
            }
        }
    }

    /// The first bad value's byte offset and the check it fails.
    fn first_bad(self, bytes: &[u8]) -> Option<(usize, Check)> {
        match self {
            Kind::Scale => bytes
                .iter()
                .position(|&b| b > 0x7E)
                .map(|i| (i, Check::Nvfp4Scale(bytes[i]))),
            Kind::Fp8 => bytes
                .iter()
                .position(|&b| b & 0x7F == 0x7F)
                .map(|i| (i, Check::Fp8Element(bytes[i]))),
            Kind::Bf16 => bytes
                .chunks_exact(2)
                .map(|c| u16::from_le_bytes([c[0], c[1]]))
                .position(|v| v & 0x7F80 == 0x7F80)
                .map(|i| {
                    let bits = u16::from_le_bytes([bytes[2 * i], bytes[2 * i + 1]]);
                    (2 * i, Check::Bf16Element(bits))
                }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{bf16, e4m3};

    fn layout(dtype: KvDtype) -> PageLayout {
        PageLayout::new(2, 3, 32, 16, dtype).unwrap()
    }

    /// A page every byte of which a writer could have produced: scales and FP8 codes spread
    /// over every finite code, BF16 values of ordinary numbers.
    fn good_page(l: &PageLayout) -> Vec<u8> {
        let mut page = vec![0u8; l.page_bytes()];
        for (i, b) in page.iter_mut().enumerate() {
            *b = match l.dtype() {
                KvDtype::Nvfp4 | KvDtype::Fp8 => (i % 0x7F) as u8,
                KvDtype::Bf16 => 0,
            };
        }
        if l.dtype() == KvDtype::Bf16 {
            for (i, c) in page.chunks_exact_mut(2).enumerate() {
                c.copy_from_slice(&bf16::encode(i as f32 * -0.37).to_le_bytes());
            }
        }
        page
    }

    /// A window page of ordinary BF16 values.
    fn window_page(page_bytes: usize) -> Vec<u8> {
        let mut page = vec![0u8; page_bytes];
        for (i, c) in page.chunks_exact_mut(2).enumerate() {
            c.copy_from_slice(&bf16::encode(i as f32 * 0.5 - 7.0).to_le_bytes());
        }
        page
    }

    #[test]
    fn pages_writers_produce_pass() {
        for dtype in KvDtype::ALL {
            let l = layout(dtype);
            let window = WindowLayout::new(&l, 32).unwrap();
            for tokens in [1, 15, 16, 17, 40, 200] {
                let seq = SequencePages::new(l, window, tokens);
                for i in 0..seq.prompt_pages() {
                    assert_eq!(seq.check(i, &good_page(&l)), Ok(()), "{dtype} {tokens} {i}");
                }
                for i in seq.prompt_pages()..seq.pages() {
                    let page = window_page(l.page_bytes());
                    assert_eq!(seq.check(i, &page), Ok(()), "{dtype} {tokens} window {i}");
                }
            }
        }
    }

    #[test]
    fn a_nan_or_negative_nvfp4_scale_is_refused_and_named() {
        let l = layout(KvDtype::Nvfp4);
        let seq = SequencePages::new(l, WindowLayout::none(&l), 32);
        for code in [0x7F, 0xFF, 0x80, 0xB8] {
            let mut page = good_page(&l);
            let at = l.scale_offset(1, KvPart::V, 2, 5) + 1;
            page[at] = code;
            let fault = seq.check(1, &page).unwrap_err();
            assert_eq!(fault.check, Check::Nvfp4Scale(code));
            assert_eq!(fault.offset, at);
            let site = Site {
                layer: 1,
                part: KvPart::V,
                head: 2,
                token: 5,
            };
            assert_eq!(fault.site, Some(site));
        }
        let mut page = good_page(&l);
        page[l.scale_offset(0, KvPart::K, 0, 0)] = 0xFF;
        assert_eq!(
            seq.check(0, &page).unwrap_err().to_string(),
            "NVFP4 block scale 0xff at byte 768 (layer 0 K, head 0, token 0) is NaN: \
             scales are 0x00..=0x7e"
        );
        // Element data is E2M1, always finite: 0xFF there is two -6 codes.
        let mut page = good_page(&l);
        page[l.data_offset(0, KvPart::K, 0, 0)] = 0xFF;
        assert_eq!(seq.check(0, &page), Ok(()));
        // A whole page of 0xFF, the attack of issue 18.
        assert!(seq.check(0, &vec![0xFF; l.page_bytes()]).is_err());
    }

    #[test]
    fn fp8_nan_codes_are_refused() {
        let l = layout(KvDtype::Fp8);
        let seq = SequencePages::new(l, WindowLayout::none(&l), 16);
        for code in [0x7F, 0xFF] {
            let mut page = good_page(&l);
            let at = l.data_offset(1, KvPart::K, 1, 15) + 31;
            page[at] = code;
            let fault = seq.check(0, &page).unwrap_err();
            assert_eq!((fault.check, fault.offset), (Check::Fp8Element(code), at));
            assert_eq!(fault.site.unwrap().token, 15);
        }
        let mut page = good_page(&l);
        page[7] = 0xFE;
        assert_eq!(e4m3::decode(0xFE), -448.0, "the most negative finite code");
        assert_eq!(seq.check(0, &page), Ok(()));
    }

    #[test]
    fn bf16_nan_and_infinity_are_refused() {
        let l = layout(KvDtype::Bf16);
        let seq = SequencePages::new(l, WindowLayout::none(&l), 16);
        for (bits, kind) in [
            (0x7F80u16, "infinite"),
            (0xFF80, "infinite"),
            (0x7FC0, "NaN"),
        ] {
            let mut page = good_page(&l);
            let at = l.data_offset(0, KvPart::V, 2, 3) + 10;
            page[at..at + 2].copy_from_slice(&bits.to_le_bytes());
            let fault = seq.check(0, &page).unwrap_err();
            assert_eq!((fault.check, fault.offset), (Check::Bf16Element(bits), at));
            assert!(fault.to_string().ends_with(kind), "{fault}");
        }
        // The largest finite BF16 passes.
        let mut page = good_page(&l);
        page[0..2].copy_from_slice(&0x7F7Fu16.to_le_bytes());
        assert_eq!(seq.check(0, &page), Ok(()));
    }

    #[test]
    fn only_the_sequences_tokens_of_its_last_page_are_checked() {
        for dtype in KvDtype::ALL {
            let l = layout(dtype);
            let seq = SequencePages::new(l, WindowLayout::none(&l), 16 + 5);
            let mut page = good_page(&l);
            // Token 5 of the last page is past the sequence: stale bytes there are legitimate.
            let stale = match dtype {
                KvDtype::Nvfp4 => l.scale_offset(1, KvPart::V, 2, 5),
                _ => l.data_offset(1, KvPart::V, 2, 5),
            };
            page[stale] = 0xFF;
            page[stale + 1] = 0xFF;
            assert_eq!(seq.check(1, &page), Ok(()), "{dtype}");
            // The same bytes in a full page, or at token 4, are refused.
            assert!(seq.check(0, &page).is_err(), "{dtype}");
            let inside = match dtype {
                KvDtype::Nvfp4 => l.scale_offset(1, KvPart::V, 2, 4),
                _ => l.data_offset(1, KvPart::V, 2, 4),
            };
            let mut page = good_page(&l);
            page[inside] = 0xFF;
            page[inside + 1] = 0xFF;
            let fault = seq.check(1, &page).unwrap_err();
            assert_eq!(fault.site.unwrap().token, 4, "{dtype}");
        }
    }

    #[test]
    fn window_values_are_checked_in_live_slots_only() {
        let l = layout(KvDtype::Nvfp4);
        let window = WindowLayout::new(&l, 32).unwrap();
        let nan = 0x7FC1u16.to_le_bytes();
        // 20 tokens: slots 0..20 of each layer are live, 20..32 stale.
        let seq = SequencePages::new(l, window, 20);
        let base = window_page(l.page_bytes());
        let (page_index, offset) = window.locate(1, KvPart::V, 1, 25);
        let mut page = base.clone();
        page[offset..offset + 2].copy_from_slice(&nan);
        assert_eq!(seq.check(seq.prompt_pages() + page_index, &page), Ok(()));
        let (page_index, offset) = window.locate(1, KvPart::V, 1, 19);
        let mut page = base.clone();
        page[offset + 6..offset + 8].copy_from_slice(&nan);
        let fault = seq
            .check(seq.prompt_pages() + page_index, &page)
            .unwrap_err();
        assert_eq!(fault.check, Check::WindowValue(0x7FC1));
        let site = Site {
            layer: 1,
            part: KvPart::V,
            head: 1,
            token: 19,
        };
        assert_eq!(fault.site, Some(site));
        assert!(fault.to_string().contains("position 19"), "{fault}");
        // Once the ring has wrapped, every slot is live: slot 25 holds position 57 of 60.
        let seq = SequencePages::new(l, window, 60);
        let (page_index, offset) = window.locate(0, KvPart::K, 0, 57);
        let mut page = base.clone();
        page[offset..offset + 2].copy_from_slice(&nan);
        let fault = seq
            .check(seq.prompt_pages() + page_index, &page)
            .unwrap_err();
        assert_eq!(fault.site.unwrap().token, 57);
        // Bytes past a window page's last unit are not checked.
        let last = window.pages() - 1;
        let used = (2 * 32 - last * window.units_per_page()) * window.unit_bytes();
        let mut page = base;
        page[used..used + 2].copy_from_slice(&nan);
        assert_eq!(seq.check(seq.prompt_pages() + last, &page), Ok(()));
    }

    #[test]
    fn wrong_lengths_and_indices_are_refused() {
        let l = layout(KvDtype::Nvfp4);
        let seq = SequencePages::new(l, WindowLayout::none(&l), 16);
        let fault = seq.check(0, &[0; 3]).unwrap_err();
        assert_eq!(
            fault.to_string(),
            format!("the page is 3 bytes, not {}", l.page_bytes())
        );
        let fault = seq.check(1, &good_page(&l)).unwrap_err();
        assert_eq!(fault.to_string(), "the sequence has 1 pages");
    }
}
