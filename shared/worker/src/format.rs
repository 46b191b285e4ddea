//! An engine's KV format as peers compare it: the domain description ([`KvFormatSpec`]) and
//! its wire form and fingerprint, the one place the worker turns it into protobuf.

use nibble_engine::paged::WorkDtype;
use nibble_kvcache::GlobalScales;
use nibble_kvfmt::{PageLayout, SequencePages, WindowLayout};
use nibble_proto::v1;

/// What decides how an engine's pages are to be read: their layout, the global scales, the
/// Hadamard rotation, the recent window and the K smoothing's digest; and the prefill work
/// dtype, which decides how a prompt's tokens are computed.
#[derive(Debug, Clone)]
pub struct KvFormatSpec {
    pub layout: PageLayout,
    pub scales: GlobalScales,
    pub hadamard: bool,
    pub window: usize,
    pub k_smoothing: Option<u64>,
    /// The digest of the factors K's codes are chosen with, if they are.
    pub k_codes: Option<u64>,
    /// The dtype prefill and extend attention hold K/V in.
    pub prefill_work: WorkDtype,
}

impl KvFormatSpec {
    /// The wire message (`Info`, registration).
    pub fn wire(&self) -> v1::KvFormat {
        v1::KvFormat::new(&self.layout, &self.scales, self.hadamard, self.window)
            .with_k_smoothing(self.k_smoothing)
            .with_k_codes(self.k_codes)
            .with_prefill_work(self.prefill_work.into())
    }

    /// The fingerprint peers compare before pages move.
    pub fn fingerprint(&self) -> u64 {
        self.wire().fingerprint()
    }

    /// What the pages of a sequence of `tokens` tokens must hold, to check received ones.
    pub fn sequence(&self, tokens: usize) -> SequencePages {
        let window = WindowLayout::new(&self.layout, self.window)
            .expect("the engine was built with this window");
        SequencePages::new(self.layout, window, tokens)
    }

    /// A one-line description for refusals and logs.
    pub fn describe(&self) -> String {
        self.wire().describe()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nibble_kvfmt::KvDtype;

    #[test]
    fn the_prefill_work_dtype_is_part_of_the_format() {
        let layout = PageLayout::new(2, 3, 64, 16, KvDtype::Nvfp4).unwrap();
        let spec = |prefill_work| KvFormatSpec {
            layout,
            scales: GlobalScales::uncalibrated(KvDtype::Nvfp4, 2),
            hadamard: false,
            window: 48,
            k_smoothing: None,
            k_codes: None,
            prefill_work,
        };
        let (bf16, fp8) = (spec(WorkDtype::Bf16), spec(WorkDtype::Fp8));
        assert_ne!(bf16.fingerprint(), fp8.fingerprint());
        assert!(
            bf16.describe().ends_with(", prefill over bf16 K/V"),
            "{}",
            bf16.describe()
        );
        // FP8, what builds before the field used, leaves the fingerprint as they had it.
        assert_eq!(
            fp8.fingerprint(),
            v1::KvFormat::new(&layout, &fp8.scales, false, 48).fingerprint()
        );
        assert!(!fp8.describe().contains("prefill"), "{}", fp8.describe());
    }
}
