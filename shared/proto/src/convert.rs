//! Conversions between wire messages and the domain types of `nibble-kvfmt` and `nibble-kvcache`.
//!
//! Domain → wire is infallible. Wire → domain validates and names the offending field in its
//! [`ConvertError`], so a service converts once at its edge and works with valid values after.

use nibble_kvcache::{BlockHash, GlobalScales, KvEventData};
use nibble_kvfmt::{check_global_scale, PageLayout};

use crate::v1;
use crate::ConvertError;

impl From<nibble_kvfmt::KvDtype> for v1::KvDtype {
    fn from(dtype: nibble_kvfmt::KvDtype) -> Self {
        match dtype {
            nibble_kvfmt::KvDtype::Bf16 => v1::KvDtype::Bf16,
            nibble_kvfmt::KvDtype::Fp8 => v1::KvDtype::Fp8,
            nibble_kvfmt::KvDtype::Nvfp4 => v1::KvDtype::Nvfp4,
        }
    }
}

/// Reads a wire dtype (the raw `i32` of a message field); `field` names it in the error.
pub fn kv_dtype(value: i32, field: &'static str) -> Result<nibble_kvfmt::KvDtype, ConvertError> {
    match v1::KvDtype::try_from(value) {
        Ok(v1::KvDtype::Bf16) => Ok(nibble_kvfmt::KvDtype::Bf16),
        Ok(v1::KvDtype::Fp8) => Ok(nibble_kvfmt::KvDtype::Fp8),
        Ok(v1::KvDtype::Nvfp4) => Ok(nibble_kvfmt::KvDtype::Nvfp4),
        Ok(v1::KvDtype::Unspecified) | Err(_) => Err(ConvertError::Unspecified { field, value }),
    }
}

impl v1::KvFormat {
    /// The wire description of a pool's format; `hadamard`: head vectors stored rotated;
    /// `window`: tokens of each sequence's BF16 recent window.
    pub fn new(layout: &PageLayout, scales: &GlobalScales, hadamard: bool, window: usize) -> Self {
        let count = |n: usize| u32::try_from(n).expect("PageLayout bounds every count to 4096");
        Self {
            dtype: v1::KvDtype::from(layout.dtype()) as i32,
            page_size: count(layout.page_size()),
            layers: count(layout.layers()),
            kv_heads: count(layout.kv_heads()),
            head_dim: count(layout.head_dim()),
            k_scales: scales.k.clone(),
            v_scales: scales.v.clone(),
            hadamard,
            window: u32::try_from(window).expect("a window is at most the context"),
            k_smoothing: 0,
            k_codes: 0,
            prefill_work: 0,
        }
    }

    /// The same format with prefill and extend attention over `work` K/V (bf16 or fp8).
    pub fn with_prefill_work(self, work: nibble_kvfmt::KvDtype) -> Self {
        Self {
            prefill_work: v1::KvDtype::from(work) as i32,
            ..self
        }
    }

    /// The cache's own prefill work dtype as the wire names it: FP8 for fp8 and nvfp4, BF16
    /// for bf16 (builds before `prefill_work` existed always used it).
    fn own_prefill_work(&self) -> i32 {
        if self.dtype == v1::KvDtype::Bf16 as i32 {
            v1::KvDtype::Bf16 as i32
        } else {
            v1::KvDtype::Fp8 as i32
        }
    }

    /// `prefill_work` when it names a work dtype other than the cache's own, else `None`.
    pub(crate) fn prefill_work_override(&self) -> Option<i32> {
        (self.prefill_work != 0 && self.prefill_work != self.own_prefill_work())
            .then_some(self.prefill_work)
    }

    /// The same format with K smoothed by multipliers of this digest (`None`: not smoothed).
    pub fn with_k_smoothing(self, digest: Option<u64>) -> Self {
        Self {
            k_smoothing: digest.unwrap_or(0),
            ..self
        }
    }

    /// The same format with K's codes chosen with factors of this digest (`None`: nearest codes).
    pub fn with_k_codes(self, digest: Option<u64>) -> Self {
        Self {
            k_codes: digest.unwrap_or(0),
            ..self
        }
    }

    /// The format in words, for errors that name what a peer must match: the dtype, page size,
    /// geometry, recent window, rotation and whether the global scales are calibrated.
    pub fn describe(&self) -> String {
        let dtype = kv_dtype(self.dtype, "kv_format.dtype").map_or_else(
            |_| format!("dtype {}", self.dtype),
            |d| d.name().to_string(),
        );
        let uncalibrated = kv_dtype(self.dtype, "kv_format.dtype")
            .map(|d| GlobalScales::uncalibrated(d, 1).k[0])
            .unwrap_or(1.0);
        let calibrated = self
            .k_scales
            .iter()
            .chain(&self.v_scales)
            .any(|g| *g != uncalibrated);
        format!(
            "{dtype}, {}-token pages, {} layers x {} KV heads x {}, recent window {}, {}, {}{}{}{}",
            self.page_size,
            self.layers,
            self.kv_heads,
            self.head_dim,
            self.window,
            if self.hadamard {
                "Hadamard"
            } else {
                "no Hadamard"
            },
            if calibrated {
                "calibrated scales"
            } else {
                "uncalibrated scales"
            },
            if self.k_smoothing != 0 {
                ", K smoothed"
            } else {
                ""
            },
            if self.k_codes != 0 {
                ", K codes for the queries"
            } else {
                ""
            },
            match self
                .prefill_work_override()
                .map(|w| kv_dtype(w, "kv_format.prefill_work"))
            {
                Some(Ok(work)) => format!(", prefill over {work} K/V"),
                Some(Err(_)) => format!(", prefill work dtype {}", self.prefill_work),
                None => String::new(),
            },
        )
    }

    /// The validated page layout and global scales this message describes.
    pub fn to_domain(&self) -> Result<(PageLayout, GlobalScales), ConvertError> {
        let dtype = kv_dtype(self.dtype, "kv_format.dtype")?;
        let layout = PageLayout::new(
            self.layers as usize,
            self.kv_heads as usize,
            self.head_dim as usize,
            self.page_size as usize,
            dtype,
        )
        .map_err(ConvertError::Layout)?;
        for (field, scales) in [("k_scales", &self.k_scales), ("v_scales", &self.v_scales)] {
            if scales.len() != layout.layers() {
                return Err(ConvertError::ScaleCount {
                    field,
                    expected: layout.layers(),
                    got: scales.len(),
                });
            }
            for (layer, g) in scales.iter().enumerate() {
                check_global_scale(*g).map_err(|source| ConvertError::Scale {
                    field,
                    layer,
                    source,
                })?;
            }
        }
        let scales = GlobalScales {
            k: self.k_scales.clone(),
            v: self.v_scales.clone(),
        };
        Ok((layout, scales))
    }
}

impl From<&nibble_kvcache::KvEvent> for v1::KvEvent {
    fn from(event: &nibble_kvcache::KvEvent) -> Self {
        let data = match &event.data {
            KvEventData::Stored { parent, blocks } => {
                v1::kv_event::Data::Stored(v1::BlocksStored {
                    parent: parent.map(|p| p.0),
                    blocks: blocks.iter().map(|b| b.0).collect(),
                })
            }
            KvEventData::Removed { blocks } => v1::kv_event::Data::Removed(v1::BlocksRemoved {
                blocks: blocks.iter().map(|b| b.0).collect(),
            }),
        };
        Self {
            id: event.id,
            data: Some(data),
        }
    }
}

impl TryFrom<v1::KvEvent> for nibble_kvcache::KvEvent {
    type Error = ConvertError;

    fn try_from(event: v1::KvEvent) -> Result<Self, ConvertError> {
        let hashes = |blocks: Vec<u64>| blocks.into_iter().map(BlockHash).collect();
        let data = match event.data.ok_or(ConvertError::Missing("kv_event.data"))? {
            v1::kv_event::Data::Stored(stored) => KvEventData::Stored {
                parent: stored.parent.map(BlockHash),
                blocks: hashes(stored.blocks),
            },
            v1::kv_event::Data::Removed(removed) => KvEventData::Removed {
                blocks: hashes(removed.blocks),
            },
        };
        Ok(Self { id: event.id, data })
    }
}

impl v1::KvSnapshotResponse {
    /// The wire form of a cache snapshot taken during the life `instance_id` of the cache.
    pub fn new(instance_id: u64, snapshot: &nibble_kvcache::KvSnapshot) -> Self {
        Self {
            instance_id,
            last_event_id: snapshot.last_event_id,
            blocks: snapshot
                .blocks
                .iter()
                .map(|(hash, parent)| v1::CachedBlock {
                    hash: hash.0,
                    parent: parent.map(|p| p.0),
                })
                .collect(),
        }
    }

    /// The snapshot this message carries (its instance id stays in the message).
    pub fn to_domain(&self) -> nibble_kvcache::KvSnapshot {
        nibble_kvcache::KvSnapshot {
            last_event_id: self.last_event_id,
            blocks: self
                .blocks
                .iter()
                .map(|b| (BlockHash(b.hash), b.parent.map(BlockHash)))
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nibble_kvfmt::KvDtype;

    fn layout(dtype: KvDtype) -> PageLayout {
        PageLayout::new(30, 3, 64, 16, dtype).unwrap()
    }

    #[test]
    fn kv_format_round_trips_for_every_dtype() {
        for dtype in KvDtype::ALL {
            let mut scales = GlobalScales::ones(30);
            scales.k[3] = 0.25;
            scales.v[29] = 4.0;
            let wire = v1::KvFormat::new(&layout(dtype), &scales, false, 0);
            let (back, back_scales) = wire.to_domain().unwrap();
            assert_eq!(back, layout(dtype));
            assert_eq!(back_scales, scales);
        }
    }

    #[test]
    fn fingerprint_tells_dtypes_apart() {
        let scales = GlobalScales::ones(30);
        let prints: Vec<u64> = KvDtype::ALL
            .iter()
            .map(|d| v1::KvFormat::new(&layout(*d), &scales, false, 0).fingerprint())
            .collect();
        assert_ne!(prints[0], prints[1]);
        assert_ne!(prints[1], prints[2]);
        assert_ne!(prints[0], prints[2]);
    }

    #[test]
    fn invalid_formats_name_the_field() {
        let good = v1::KvFormat::new(&layout(KvDtype::Nvfp4), &GlobalScales::ones(30), false, 0);
        assert_eq!(
            v1::KvFormat::new(
                &layout(KvDtype::Nvfp4),
                &GlobalScales::uncalibrated(KvDtype::Nvfp4, 30),
                true,
                64
            )
            .describe(),
            "nvfp4, 16-token pages, 30 layers x 3 KV heads x 64, recent window 64, Hadamard, \
             uncalibrated scales"
        );
        assert_eq!(
            good.clone().with_k_smoothing(Some(7)).describe(),
            "nvfp4, 16-token pages, 30 layers x 3 KV heads x 64, recent window 0, no Hadamard, \
             calibrated scales, K smoothed"
        );
        assert_ne!(
            good.clone().with_k_smoothing(Some(7)).fingerprint(),
            good.fingerprint()
        );
        assert_eq!(good.clone().with_k_smoothing(None), good);
        assert_eq!(
            good.clone().with_k_codes(Some(9)).describe(),
            "nvfp4, 16-token pages, 30 layers x 3 KV heads x 64, recent window 0, no Hadamard, \
             calibrated scales, K codes for the queries"
        );
        assert_ne!(
            good.clone().with_k_codes(Some(9)).fingerprint(),
            good.fingerprint()
        );
        assert_eq!(good.clone().with_k_codes(None), good);
        let err = |f: v1::KvFormat| f.to_domain().unwrap_err().to_string();

        let unspecified = v1::KvFormat {
            dtype: 0,
            ..good.clone()
        };
        assert_eq!(
            err(unspecified),
            "kv_format.dtype must be set to a known value, got 0"
        );
        let unknown = v1::KvFormat {
            dtype: 42,
            ..good.clone()
        };
        assert!(err(unknown).contains("got 42"));
        let no_layers = v1::KvFormat {
            layers: 0,
            ..good.clone()
        };
        assert!(err(no_layers).starts_with("kv_format: layers"));
        let odd_dim = v1::KvFormat {
            head_dim: 72,
            ..good.clone()
        };
        assert!(err(odd_dim).starts_with("kv_format: "));
        let short = v1::KvFormat {
            v_scales: vec![1.0; 29],
            ..good.clone()
        };
        assert_eq!(
            err(short),
            "kv_format.v_scales must have one entry per layer (30), got 29"
        );
        let mut bad_scale = good.clone();
        bad_scale.k_scales[7] = f32::NAN;
        assert!(err(bad_scale).starts_with("kv_format.k_scales[7]: "));
        let mut negative = good;
        negative.v_scales[0] = -1.0;
        assert!(err(negative).starts_with("kv_format.v_scales[0]: "));
    }

    #[test]
    fn events_round_trip() {
        let events = [
            nibble_kvcache::KvEvent {
                id: 1,
                data: KvEventData::Stored {
                    parent: None,
                    blocks: vec![BlockHash(1), BlockHash(u64::MAX)],
                },
            },
            nibble_kvcache::KvEvent {
                id: 2,
                data: KvEventData::Stored {
                    parent: Some(BlockHash(u64::MAX)),
                    blocks: vec![BlockHash(7)],
                },
            },
            nibble_kvcache::KvEvent {
                id: 3,
                data: KvEventData::Removed {
                    blocks: vec![BlockHash(7)],
                },
            },
        ];
        for event in &events {
            let wire = v1::KvEvent::from(event);
            assert_eq!(&nibble_kvcache::KvEvent::try_from(wire).unwrap(), event);
        }
        let empty = v1::KvEvent { id: 4, data: None };
        assert_eq!(
            nibble_kvcache::KvEvent::try_from(empty)
                .unwrap_err()
                .to_string(),
            "kv_event.data is required"
        );
    }

    #[test]
    fn snapshot_round_trips() {
        let snapshot = nibble_kvcache::KvSnapshot {
            last_event_id: 9,
            blocks: vec![(BlockHash(1), None), (BlockHash(2), Some(BlockHash(1)))],
        };
        let wire = v1::KvSnapshotResponse::new(77, &snapshot);
        assert_eq!(wire.instance_id, 77);
        assert_eq!(wire.to_domain(), snapshot);
    }

    #[test]
    fn errors_become_invalid_argument() {
        let status = tonic::Status::from(ConvertError::Missing("kv_event.data"));
        assert_eq!(status.code(), tonic::Code::InvalidArgument);
        assert_eq!(status.message(), "kv_event.data is required");
    }
}
