//! Calibration of the KV cache's global scales: the largest |K| and |V| each layer produces on
//! sample text, turned into per-(layer, K|V) dequantization multipliers.
//!
//! For NVFP4 the scale maps the layer's amax onto the largest block scale, `amax / (6 · 448)`,
//! so no block scale saturates; for FP8 it maps amax onto the largest E4M3 value, `amax / 448`.
//! BF16 needs none. A layer whose K or V is all zero gets the dtype's uncalibrated scale
//! ([`GlobalScales::uncalibrated`]). The JSON file records the amax
//! values and the scales for both dtypes, so one calibration serves either cache.

use serde::{Deserialize, Serialize};

use crate::backend::Backend;
use crate::error::{Error, Result};
use crate::kv::{ContiguousKv, KvBatch, KvStore, NewTokens, StepTokens};
use crate::model::{Logits, Model};
use nibble_kvcache::GlobalScales;
use nibble_kvfmt::KvDtype;

/// Largest finite E4M3 value.
const E4M3_MAX: f32 = 448.0;
/// Largest E2M1 value.
const E2M1_MAX: f32 = 6.0;

/// Per-layer amax of K (after RoPE) and V, and per-channel amax of K.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Calibration {
    /// What the numbers were measured on, for the record.
    pub source: String,
    /// Tokens that went through the model.
    pub tokens: usize,
    pub k_amax: Vec<f32>,
    pub v_amax: Vec<f32>,
    /// Per layer, the amax of each of K's `kv_heads · head_dim` channels (empty in files
    /// written before channels were measured: such a calibration cannot smooth K).
    pub k_channel_amax: Vec<Vec<f32>>,
}

/// Per-channel K smoothing: post-RoPE, each K channel is multiplied by `k[layer][c]` before it
/// is cached and the matching channel of every query head that reads it by `1 / k[layer][c]`,
/// so every attention score is unchanged while K's channels all reach the same amax. NVFP4
/// shares one block scale among 16 channels of a head vector; without smoothing a channel that
/// reaches 200 (Qwen2.5's bias-driven K channels) leaves its block's small channels a few codes.
#[derive(Debug, Clone, PartialEq)]
pub struct KSmoothing {
    /// Per layer, the multiplier of each K channel (`kv_heads · head_dim`).
    pub k: Vec<Vec<f32>>,
}

impl KSmoothing {
    /// The per-layer multipliers of Q's `num_heads · head_dim` channels: the reciprocal of the
    /// K channel each query head reads (query head `h` reads KV head `h / group`).
    pub fn q(&self, num_heads: usize, head_dim: usize) -> Vec<Vec<f32>> {
        self.k
            .iter()
            .map(|k| {
                let group = num_heads / (k.len() / head_dim).max(1);
                (0..num_heads * head_dim)
                    .map(|i| {
                        let (head, c) = (i / head_dim, i % head_dim);
                        1.0 / k[(head / group) * head_dim + c]
                    })
                    .collect()
            })
            .collect()
    }

    /// A digest of the multipliers, for the KV-format fingerprint: two workers exchange pages
    /// only if they smooth K identically.
    pub fn digest(&self) -> u64 {
        // FNV-1a over the multipliers' bits: stable across builds and machines.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for x in self.k.iter().flatten() {
            for b in x.to_bits().to_le_bytes() {
                h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        h
    }
}

impl Calibration {
    /// The K smoothing this calibration's channel amax give, or `None` for a file without them.
    /// Each layer's channels are scaled onto the geometric mean of its channel amax (so K's
    /// overall magnitude stays about the same); a channel that never moved keeps 1.0.
    pub fn smoothing(&self) -> Option<KSmoothing> {
        if self.k_channel_amax.is_empty() {
            return None;
        }
        let k = self
            .k_channel_amax
            .iter()
            .map(|amax| {
                let live: Vec<f64> = amax
                    .iter()
                    .filter(|a| **a > 0.0)
                    .map(|a| f64::from(*a).ln())
                    .collect();
                let mean = (live.iter().sum::<f64>() / live.len().max(1) as f64).exp();
                amax.iter()
                    .map(|a| {
                        if *a > 0.0 {
                            (mean / f64::from(*a)) as f32
                        } else {
                            1.0
                        }
                    })
                    .collect()
            })
            .collect();
        Some(KSmoothing { k })
    }

    /// This calibration as seen through `smoothing`: each layer's K amax is that of the
    /// smoothed channels, so the global scales fit the K that is cached.
    pub fn smoothed(&self, smoothing: &KSmoothing) -> Self {
        let k_amax = self
            .k_channel_amax
            .iter()
            .zip(&smoothing.k)
            .map(|(amax, k)| amax.iter().zip(k).fold(0.0f32, |m, (a, k)| m.max(a * k)))
            .collect();
        Self {
            k_amax,
            ..self.clone()
        }
    }

    /// The global scales for a `dtype` cache.
    pub fn scales(&self, dtype: KvDtype) -> GlobalScales {
        let divisor = match dtype {
            KvDtype::Nvfp4 => E2M1_MAX * E4M3_MAX,
            KvDtype::Fp8 => E4M3_MAX,
            KvDtype::Bf16 => return GlobalScales::ones(self.k_amax.len()),
        };
        let fallback = GlobalScales::uncalibrated(dtype, 1).k[0];
        let scale = |amax: &f32| {
            if *amax > 0.0 && amax.is_finite() {
                amax / divisor
            } else {
                fallback
            }
        };
        GlobalScales {
            k: self.k_amax.iter().map(scale).collect(),
            v: self.v_amax.iter().map(scale).collect(),
        }
    }

    /// The JSON file's contents: amax values plus the derived scales of both quantized dtypes.
    pub fn to_json(&self) -> Result<String> {
        let file = CalibrationFile {
            source: self.source.clone(),
            tokens: self.tokens,
            k_amax: self.k_amax.clone(),
            v_amax: self.v_amax.clone(),
            k_channel_amax: self.k_channel_amax.clone(),
            nvfp4: self.scales(KvDtype::Nvfp4),
            fp8: self.scales(KvDtype::Fp8),
        };
        serde_json::to_string_pretty(&file)
            .map_err(|e| Error::InvalidInput(format!("serializing calibration: {e}")))
    }

    /// Reads a calibration file, checking it has one K and one V value per layer.
    pub fn from_json(text: &str, layers: usize) -> Result<Self> {
        let file: CalibrationFile = serde_json::from_str(text)
            .map_err(|e| Error::InvalidInput(format!("calibration file: {e}")))?;
        if file.k_amax.len() != layers || file.v_amax.len() != layers {
            return Err(Error::InvalidInput(format!(
                "calibration file has {} K and {} V values; the model has {layers} layers",
                file.k_amax.len(),
                file.v_amax.len()
            )));
        }
        if !file.k_channel_amax.is_empty() && file.k_channel_amax.len() != layers {
            return Err(Error::InvalidInput(format!(
                "calibration file has K channels for {} layers; the model has {layers}",
                file.k_channel_amax.len()
            )));
        }
        if let Some(bad) = file
            .k_amax
            .iter()
            .chain(&file.v_amax)
            .chain(file.k_channel_amax.iter().flatten())
            .find(|x| !x.is_finite() || **x < 0.0)
        {
            return Err(Error::InvalidInput(format!(
                "calibration file: amax {bad} is not a finite non-negative number"
            )));
        }
        Ok(Self {
            source: file.source,
            tokens: file.tokens,
            k_amax: file.k_amax,
            v_amax: file.v_amax,
            k_channel_amax: file.k_channel_amax,
        })
    }
}

#[derive(Serialize, Deserialize)]
struct CalibrationFile {
    source: String,
    tokens: usize,
    k_amax: Vec<f32>,
    v_amax: Vec<f32>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    k_channel_amax: Vec<Vec<f32>>,
    nvfp4: GlobalScales,
    fp8: GlobalScales,
}

/// A single-sequence f32 cache that records every layer's amax as K and V pass through.
struct Recorder<'a, B: Backend> {
    kv: &'a mut ContiguousKv<B>,
    k_amax: Vec<f32>,
    v_amax: Vec<f32>,
    k_channel_amax: Vec<Vec<f32>>,
    host: Vec<f32>,
}

impl<B: Backend> KvBatch<B> for Recorder<'_, B> {
    fn sequences(&self) -> usize {
        1
    }

    fn stored(&self, _seq: usize) -> usize {
        self.kv.len()
    }

    fn reserve(&mut self, backend: &B, new: &[usize]) -> Result<()> {
        self.kv.reserve(backend, new[0])
    }

    fn attend(
        &mut self,
        backend: &B,
        layer: usize,
        step: &StepTokens<'_, B::Tensor>,
        out: &mut B::Tensor,
    ) -> Result<()> {
        let rows = step.spans[0].clone();
        for (tensor, amax) in [
            (step.k, &mut self.k_amax[layer]),
            (step.v, &mut self.v_amax[layer]),
        ] {
            self.host.clear();
            backend.download_rows(tensor, rows.clone(), &mut self.host);
            *amax = self.host.iter().fold(*amax, |m, x| m.max(x.abs()));
        }
        // `host` holds this step's V; K again for its channels.
        self.host.clear();
        backend.download_rows(step.k, rows.clone(), &mut self.host);
        let channels = &mut self.k_channel_amax[layer];
        let width = step.geometry.num_kv_heads * step.geometry.head_dim;
        channels.resize(width, 0.0);
        for row in self.host.chunks_exact(width) {
            for (m, x) in channels.iter_mut().zip(row) {
                *m = m.max(x.abs());
            }
        }
        let new = NewTokens {
            q: step.q,
            k: step.k,
            v: step.v,
            rows,
            geometry: step.geometry,
        };
        self.kv.attend(backend, layer, &new, out)
    }

    fn commit(&mut self, new: &[usize]) {
        self.kv.commit(new[0]);
    }
}

/// Runs `tokens` through `model` in windows of `window` tokens and records every layer's amax.
pub fn calibrate<B: Backend>(
    model: &Model<B>,
    tokens: &[u32],
    window: usize,
    source: &str,
) -> Result<Calibration> {
    if tokens.is_empty() || window == 0 {
        return Err(Error::InvalidInput(
            "calibration needs at least one token and a positive window".into(),
        ));
    }
    let layers = model.config().num_layers;
    let mut ws = model.workspace();
    let mut logits = Vec::new();
    let (mut k_amax, mut v_amax) = (vec![0.0f32; layers], vec![0.0f32; layers]);
    let mut k_channel_amax = vec![Vec::new(); layers];
    for chunk in tokens.chunks(window) {
        let mut kv = model.new_kv(chunk.len());
        let mut recorder = Recorder {
            kv: &mut kv,
            k_amax,
            v_amax,
            k_channel_amax,
            host: Vec::new(),
        };
        model.forward_batch(&mut ws, &[chunk], &mut recorder, Logits::None, &mut logits)?;
        k_amax = recorder.k_amax;
        v_amax = recorder.v_amax;
        k_channel_amax = recorder.k_channel_amax;
    }
    Ok(Calibration {
        source: source.to_string(),
        tokens: tokens.len(),
        k_amax,
        v_amax,
        k_channel_amax,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scales_map_amax_to_the_format_maximum() {
        let c = Calibration {
            source: "test".into(),
            tokens: 10,
            k_amax: vec![2688.0, 0.0],
            v_amax: vec![4.48, 1.0],
            k_channel_amax: Vec::new(),
        };
        let nvfp4 = c.scales(KvDtype::Nvfp4);
        assert_eq!(
            nvfp4.k,
            vec![1.0, 1.0 / 6.0],
            "an all-zero layer keeps the uncalibrated scale"
        );
        let fp8 = c.scales(KvDtype::Fp8);
        assert_eq!(fp8.k[0], 6.0);
        assert!((fp8.v[0] - 0.01).abs() < 1e-7);
        let json = c.to_json().unwrap();
        assert_eq!(Calibration::from_json(&json, 2).unwrap(), c);
        let err = Calibration::from_json(&json, 3).unwrap_err();
        assert!(err.to_string().contains("model has 3 layers"), "{err}");
        assert!(Calibration::from_json("{", 2).is_err());
    }

    fn with_channels(k_channel_amax: Vec<Vec<f32>>) -> Calibration {
        Calibration {
            source: "test".into(),
            tokens: 10,
            k_amax: k_channel_amax
                .iter()
                .map(|c| c.iter().fold(0.0f32, |m, x| m.max(*x)))
                .collect(),
            v_amax: vec![1.0; k_channel_amax.len()],
            k_channel_amax,
        }
    }

    #[test]
    fn smoothing_brings_every_channel_to_the_geometric_mean() {
        // Live channels 1, 4 and 16 (geometric mean 4); a dead one keeps 1.0.
        let c = with_channels(vec![vec![1.0, 4.0, 0.0, 16.0], vec![2.0; 4]]);
        let s = c.smoothing().unwrap();
        assert_eq!(s.k, vec![vec![4.0, 1.0, 1.0, 0.25], vec![1.0; 4]]);
        // Two query heads of two dims over two KV heads of two: each reads its own.
        assert_eq!(s.q(2, 2)[0], vec![0.25, 1.0, 1.0, 4.0]);
        // Four query heads over the same two KV heads: pairs share one.
        assert_eq!(s.q(4, 2)[0], vec![0.25, 1.0, 0.25, 1.0, 1.0, 4.0, 1.0, 4.0]);
        let smoothed = c.smoothed(&s);
        assert_eq!(smoothed.k_amax, vec![4.0, 2.0]);
        assert_eq!(smoothed.v_amax, c.v_amax);
        // The digest follows the multipliers.
        let other = with_channels(vec![vec![1.0, 4.0, 0.0, 8.0], vec![2.0; 4]]);
        assert_ne!(other.smoothing().unwrap().digest(), s.digest());
        assert_eq!(c.smoothing().unwrap().digest(), s.digest());
        // A file written before channels were measured cannot smooth.
        let old = Calibration {
            k_channel_amax: Vec::new(),
            ..c.clone()
        };
        assert!(old.smoothing().is_none());
    }

    #[test]
    fn channels_survive_the_file_and_are_checked() {
        let c = with_channels(vec![vec![1.0, 4.0], vec![2.0, 3.0]]);
        let json = c.to_json().unwrap();
        assert_eq!(Calibration::from_json(&json, 2).unwrap(), c);
        let three = Calibration {
            k_channel_amax: vec![vec![1.0]; 3],
            ..c.clone()
        };
        let err = Calibration::from_json(&three.to_json().unwrap(), 2).unwrap_err();
        assert!(err.to_string().contains("K channels for 3 layers"), "{err}");
        let mut bad = c.clone();
        bad.k_channel_amax[1][0] = -1.0;
        let err = Calibration::from_json(&bad.to_json().unwrap(), 2).unwrap_err();
        assert!(err.to_string().contains("amax -1"), "{err}");
    }

    #[test]
    fn a_kv_config_smooths_only_with_measured_channels() {
        use crate::KvConfig;
        let c = with_channels(vec![vec![1.0, 4.0, 16.0], vec![2.0; 3]]);
        let kv = KvConfig::new(KvDtype::Nvfp4).with_calibration(&c, true);
        let s = c.smoothing().unwrap();
        assert_eq!(kv.scales, Some(c.smoothed(&s).scales(KvDtype::Nvfp4)));
        assert_eq!(kv.k_smoothing, Some(s));
        let plain = KvConfig::new(KvDtype::Fp8).with_calibration(&c, false);
        assert_eq!(plain.scales, Some(c.scales(KvDtype::Fp8)));
        assert_eq!(plain.k_smoothing, None);
        let old = Calibration {
            k_channel_amax: Vec::new(),
            ..c.clone()
        };
        let kv = KvConfig::new(KvDtype::Nvfp4).with_calibration(&old, true);
        assert_eq!(kv.k_smoothing, None);
        assert_eq!(kv.scales, Some(c.scales(KvDtype::Nvfp4)));
    }
}
