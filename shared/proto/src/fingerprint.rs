//! The KV-format fingerprint: a stable 64-bit hash of a [`KvFormat`].
//!
//! Two workers may exchange pages only when their fingerprints are equal. The hash covers every
//! field that changes how page bytes are read: dtype, page size, layers, KV heads, head dim, the
//! bit patterns of every global scale (a different scale silently reinterprets every byte) and
//! the Hadamard rotation, the recent window, the K smoothing's digest and a prefill work dtype
//! other than the cache's own (each appended only when it is on, so the
//! fingerprints of formats without them are those of builds before the fields existed). It is
//! `xxh3_64` with a fixed seed over a canonical little-endian encoding, so it is the same in every
//! process, on every machine, and independent of protobuf's encoding of the message.

use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::v1::KvFormat;

/// Seed of the fingerprint hash ("nibblekv").
const SEED: u64 = 0x6e69_6262_6c65_6b76;

impl KvFormat {
    /// The format's fingerprint (see the module docs). Changing this function breaks
    /// compatibility between workers of different builds.
    pub fn fingerprint(&self) -> u64 {
        let mut bytes = Vec::with_capacity(32 + 4 * (self.k_scales.len() + self.v_scales.len()));
        bytes.extend_from_slice(&self.dtype.to_le_bytes());
        for n in [self.page_size, self.layers, self.kv_heads, self.head_dim] {
            bytes.extend_from_slice(&n.to_le_bytes());
        }
        for scales in [&self.k_scales, &self.v_scales] {
            bytes.extend_from_slice(&(scales.len() as u64).to_le_bytes());
            for g in scales.iter() {
                bytes.extend_from_slice(&g.to_bits().to_le_bytes());
            }
        }
        if self.hadamard {
            bytes.push(1);
        }
        if self.window > 0 {
            bytes.push(b'w');
            bytes.extend_from_slice(&self.window.to_le_bytes());
        }
        if self.k_smoothing != 0 {
            bytes.push(b's');
            bytes.extend_from_slice(&self.k_smoothing.to_le_bytes());
        }
        if self.k_codes != 0 {
            bytes.push(b'c');
            bytes.extend_from_slice(&self.k_codes.to_le_bytes());
        }
        if let Some(work) = self.prefill_work_override() {
            bytes.push(b'p');
            bytes.extend_from_slice(&work.to_le_bytes());
        }
        xxh3_64_with_seed(&bytes, SEED)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::v1::KvDtype;

    fn smollm() -> KvFormat {
        KvFormat {
            dtype: KvDtype::Nvfp4 as i32,
            page_size: 16,
            layers: 2,
            kv_heads: 3,
            head_dim: 64,
            k_scales: vec![1.0, 1.0],
            v_scales: vec![1.0, 1.0],
            hadamard: false,
            window: 0,
            k_smoothing: 0,
            prefill_work: 0,
            k_codes: 0,
        }
    }

    #[test]
    fn every_field_changes_it() {
        let base = smollm();
        let variants: Vec<(&str, KvFormat)> = vec![
            (
                "dtype",
                KvFormat {
                    dtype: KvDtype::Fp8 as i32,
                    ..base.clone()
                },
            ),
            (
                "page size",
                KvFormat {
                    page_size: 32,
                    ..base.clone()
                },
            ),
            (
                "layers",
                KvFormat {
                    layers: 3,
                    ..base.clone()
                },
            ),
            (
                "kv heads",
                KvFormat {
                    kv_heads: 4,
                    ..base.clone()
                },
            ),
            (
                "head dim",
                KvFormat {
                    head_dim: 128,
                    ..base.clone()
                },
            ),
            (
                "k scale",
                KvFormat {
                    k_scales: vec![1.0, 0.5],
                    ..base.clone()
                },
            ),
            (
                "v scale",
                KvFormat {
                    v_scales: vec![0.5, 1.0],
                    ..base.clone()
                },
            ),
            (
                "hadamard",
                KvFormat {
                    hadamard: true,
                    ..base.clone()
                },
            ),
            (
                "window",
                KvFormat {
                    window: 64,
                    ..base.clone()
                },
            ),
            (
                "K codes",
                KvFormat {
                    k_codes: 5,
                    ..base.clone()
                },
            ),
            (
                "prefill work dtype",
                KvFormat {
                    prefill_work: KvDtype::Bf16 as i32,
                    ..base.clone()
                },
            ),
            (
                "k/v swap",
                KvFormat {
                    k_scales: vec![2.0, 1.0],
                    v_scales: vec![1.0, 1.0],
                    ..base.clone()
                },
            ),
        ];
        for (what, variant) in &variants {
            assert_ne!(variant.fingerprint(), base.fingerprint(), "{what}");
        }
        // Moving a scale from K to V must change it too (lengths are part of the encoding).
        let moved = KvFormat {
            k_scales: vec![1.0],
            v_scales: vec![1.0, 1.0, 1.0],
            ..base.clone()
        };
        assert_ne!(moved.fingerprint(), base.fingerprint());
    }

    #[test]
    fn equal_formats_agree() {
        assert_eq!(smollm().fingerprint(), smollm().fingerprint());
        // Naming the cache's own work dtype (FP8 for nvfp4) is the same as naming none.
        let named = KvFormat {
            prefill_work: KvDtype::Fp8 as i32,
            ..smollm()
        };
        assert_eq!(named.fingerprint(), smollm().fingerprint());
    }

    #[test]
    fn stable_value() {
        // Changing this value makes workers of different builds refuse each other's pages.
        let format = smollm();
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&3i32.to_le_bytes());
        for n in [16u32, 2, 3, 64] {
            bytes.extend_from_slice(&n.to_le_bytes());
        }
        for _ in 0..2 {
            bytes.extend_from_slice(&2u64.to_le_bytes());
            bytes.extend_from_slice(&1.0f32.to_bits().to_le_bytes());
            bytes.extend_from_slice(&1.0f32.to_bits().to_le_bytes());
        }
        assert_eq!(format.fingerprint(), xxh3_64_with_seed(&bytes, SEED));
    }
}
