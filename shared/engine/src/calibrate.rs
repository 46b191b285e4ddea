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
use crate::hadamard;
use crate::kv::{ContiguousKv, KvBatch, KvStore, NewTokens, StepTokens};
use crate::model::{Logits, Model};
use nibble_kvcache::GlobalScales;
use nibble_kvfmt::nvfp4::feedback::{KeyFactors, QueryFactor};
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
    /// Per-layer amax of K and V after the Hadamard rotation, for a `--hadamard` cache, and of
    /// K smoothed ([`Self::smoothing`]) and then rotated. Empty when the head dim allows no
    /// rotation, or in files written before rotated vectors were measured.
    pub hadamard: HadamardAmax,
    /// The recent window (tokens) an nvfp4 cache of this model needs to keep FP8's accuracy, if
    /// the calibration names one (`nibble calibrate --nvfp4-window`): the window such a cache
    /// gets when the command line names none ([`Self::window_for`]).
    pub nvfp4_window: Option<usize>,
    /// Per layer, the mean of `q qᵀ` over the queries of each KV head's group (after RoPE,
    /// unsmoothed, unrotated): `kv_heads` upper triangles of `head_dim × head_dim`, row by row.
    /// What K's codes are chosen for ([`Self::query_factors`]); empty in files without it.
    pub q_second_moment: Vec<Vec<f32>>,
}

/// xxh3 over f32 values' little-endian bits, in order: a digest stable across builds and
/// machines, for the KV-format fingerprint.
pub(crate) fn f32_digest<'a>(values: impl Iterator<Item = &'a f32>) -> u64 {
    let bytes: Vec<u8> = values.flat_map(|x| x.to_bits().to_le_bytes()).collect();
    xxhash_rust::xxh3::xxh3_64(&bytes)
}

/// Per-layer amax of rotated vectors (see [`Calibration::hadamard`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct HadamardAmax {
    pub k_amax: Vec<f32>,
    pub v_amax: Vec<f32>,
    pub smoothed_k_amax: Vec<f32>,
}

impl HadamardAmax {
    fn is_empty(&self) -> bool {
        self.k_amax.is_empty() && self.v_amax.is_empty() && self.smoothed_k_amax.is_empty()
    }
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
        f32_digest(self.k.iter().flatten())
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

    /// The global scales of a `dtype` cache of plain K and V (neither smoothed nor rotated).
    pub fn scales(&self, dtype: KvDtype) -> GlobalScales {
        scales_of(dtype, &self.k_amax, &self.v_amax)
    }

    /// The global scales of a `dtype` cache that holds K smoothed by `smoothing` (if any) and K
    /// and V rotated when `hadamard`: each from the amax of what is cached. Fails when the
    /// calibration did not measure rotated vectors (a rotated cache with the scales of unrotated
    /// ones puts blocks into E4M3's subnormals: docs/ACCURACY.md).
    pub fn scales_for(
        &self,
        dtype: KvDtype,
        smoothing: Option<&KSmoothing>,
        hadamard: bool,
    ) -> Result<GlobalScales> {
        if !hadamard {
            return Ok(match smoothing {
                None => self.scales(dtype),
                Some(s) => scales_of(dtype, &self.smoothed_k_amax(s), &self.v_amax),
            });
        }
        let h = &self.hadamard;
        let k = if smoothing.is_some() {
            &h.smoothed_k_amax
        } else {
            &h.k_amax
        };
        if k.len() != self.k_amax.len() || h.v_amax.len() != self.v_amax.len() {
            return Err(Error::InvalidInput(
                "the calibration has no amax of Hadamard-rotated K/V (it was written before \
                 `nibble calibrate` measured them, or the head dim allows no rotation); \
                 calibrate again"
                    .into(),
            ));
        }
        Ok(scales_of(dtype, k, &h.v_amax))
    }

    /// Each layer's K amax once smoothed by `smoothing` (from the channel amax).
    fn smoothed_k_amax(&self, smoothing: &KSmoothing) -> Vec<f32> {
        self.k_channel_amax
            .iter()
            .zip(&smoothing.k)
            .map(|(amax, k)| amax.iter().zip(k).fold(0.0f32, |m, (a, k)| m.max(a * k)))
            .collect()
    }

    /// The JSON file's contents: amax values plus the derived scales of both quantized dtypes.
    pub fn to_json(&self) -> Result<String> {
        let file = CalibrationFile {
            source: self.source.clone(),
            tokens: self.tokens,
            k_amax: self.k_amax.clone(),
            v_amax: self.v_amax.clone(),
            k_channel_amax: self.k_channel_amax.clone(),
            hadamard: self.hadamard.clone(),
            nvfp4_window: self.nvfp4_window,
            q_second_moment: self.q_second_moment.clone(),
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
        let h = &file.hadamard;
        if let Some(bad) = [&h.k_amax, &h.v_amax, &h.smoothed_k_amax]
            .iter()
            .find(|a| !a.is_empty() && a.len() != layers)
        {
            return Err(Error::InvalidInput(format!(
                "calibration file has rotated amax for {} layers; the model has {layers}",
                bad.len()
            )));
        }
        if let Some(bad) = file
            .k_amax
            .iter()
            .chain(&file.v_amax)
            .chain(file.k_channel_amax.iter().flatten())
            .chain(h.k_amax.iter().chain(&h.v_amax).chain(&h.smoothed_k_amax))
            .find(|x| !x.is_finite() || **x < 0.0)
        {
            return Err(Error::InvalidInput(format!(
                "calibration file: amax {bad} is not a finite non-negative number"
            )));
        }
        if !file.q_second_moment.is_empty() {
            if file.q_second_moment.len() != layers {
                return Err(Error::InvalidInput(format!(
                    "calibration file has the queries' second moment for {} layers; the model has {layers}",
                    file.q_second_moment.len()
                )));
            }
            if file
                .q_second_moment
                .iter()
                .flatten()
                .any(|x| !x.is_finite())
            {
                return Err(Error::InvalidInput(
                    "calibration file: the queries' second moment is not finite".into(),
                ));
            }
        }
        Ok(Self {
            source: file.source,
            tokens: file.tokens,
            k_amax: file.k_amax,
            v_amax: file.v_amax,
            k_channel_amax: file.k_channel_amax,
            hadamard: file.hadamard,
            nvfp4_window: file.nvfp4_window,
            q_second_moment: file.q_second_moment,
        })
    }

    /// The factors K's codes are chosen with ([`nibble_kvfmt::nvfp4::feedback`]), one per layer
    /// and KV head (layer-major), for keys of `head_dim` values smoothed by `smoothing` and
    /// rotated when `hadamard`: the queries' second moment carried through the same transforms
    /// (a K channel multiplied by m is read by query channels divided by m; the rotation is its
    /// own inverse), damped by 1% of its mean diagonal. `None` without a second moment in the
    /// file; an error when it does not fit `head_dim` or is not positive definite.
    pub fn query_factors(
        &self,
        head_dim: usize,
        smoothing: Option<&KSmoothing>,
        hadamard: bool,
    ) -> Result<Option<KeyFactors>> {
        if self.q_second_moment.is_empty() {
            return Ok(None);
        }
        let mut kv_heads = 0;
        let d = head_dim;
        let tri = d * (d + 1) / 2;
        let mut out = Vec::new();
        for (layer, heads) in self.q_second_moment.iter().enumerate() {
            if heads.len() % tri != 0 {
                return Err(Error::InvalidInput(format!(
                    "calibration file: layer {layer}'s query second moment is not whole {d} x {d} triangles"
                )));
            }
            kv_heads = heads.len() / tri;
            if smoothing.is_some_and(|s| s.k.get(layer).map(Vec::len) != Some(kv_heads * d)) {
                return Err(Error::InvalidInput(format!(
                    "calibration file: layer {layer} has the queries' second moment of {kv_heads} KV heads and K channel amax of another count"
                )));
            }
            for (head, upper) in heads.chunks_exact(tri).enumerate() {
                let mut h = vec![0.0f64; d * d];
                let mut at = upper.iter();
                for i in 0..d {
                    for j in i..d {
                        let v = f64::from(*at.next().expect("whole triangle"));
                        h[i * d + j] = v;
                        h[j * d + i] = v;
                    }
                }
                if let Some(s) = smoothing {
                    let m = &s.k[layer][head * d..(head + 1) * d];
                    for i in 0..d {
                        for j in 0..d {
                            h[i * d + j] /= f64::from(m[i]) * f64::from(m[j]);
                        }
                    }
                }
                if hadamard {
                    rotate_both_sides(&mut h, d);
                }
                let factor = QueryFactor::from_second_moment(&h, d, 0.01).ok_or_else(|| {
                    Error::InvalidInput(format!(
                        "calibration file: the query second moment of layer {layer}, KV head {head} is not positive definite"
                    ))
                })?;
                out.push(factor);
            }
        }
        KeyFactors::new(kv_heads, out).map(Some).ok_or_else(|| {
            Error::InvalidInput(
                "calibration file: the queries' second moment has a different number of KV heads per layer"
                    .into(),
            )
        })
    }

    /// The window a `dtype` cache of this model gets when the command line names none, if the
    /// calibration names one: [`Self::nvfp4_window`] for nvfp4 (fp8 and bf16 keep their
    /// default).
    pub fn window_for(&self, dtype: KvDtype) -> Option<usize> {
        self.nvfp4_window.filter(|_| dtype == KvDtype::Nvfp4)
    }
}

/// Global scales mapping each layer's amax onto the format's range (see the module docs).
fn scales_of(dtype: KvDtype, k_amax: &[f32], v_amax: &[f32]) -> GlobalScales {
    let divisor = match dtype {
        KvDtype::Nvfp4 => E2M1_MAX * E4M3_MAX,
        KvDtype::Fp8 => E4M3_MAX,
        KvDtype::Bf16 => return GlobalScales::ones(k_amax.len()),
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
        k: k_amax.iter().map(scale).collect(),
        v: v_amax.iter().map(scale).collect(),
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
    #[serde(default, skip_serializing_if = "HadamardAmax::is_empty")]
    hadamard: HadamardAmax,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    nvfp4_window: Option<usize>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    q_second_moment: Vec<Vec<f32>>,
    nvfp4: GlobalScales,
    fp8: GlobalScales,
}

/// What one pass of the text through the model measures, per layer.
struct Measured {
    k: Vec<f32>,
    v: Vec<f32>,
    k_channels: Vec<Vec<f32>>,
    /// Of K and V rotated by the normalized Hadamard matrix (left empty when the head dim allows
    /// no rotation).
    k_rotated: Vec<f32>,
    v_rotated: Vec<f32>,
    /// Per layer, the sum of `q qᵀ` per KV head (`kv_heads · d · d`, upper triangle), and how many
    /// query vectors went into each KV head's sums.
    q_moment: Vec<Vec<f64>>,
    q_count: usize,
}

fn amax(start: f32, x: &[f32]) -> f32 {
    x.iter().fold(start, |m, x| m.max(x.abs()))
}

/// A single-sequence f32 cache that records every layer's amax as K and V pass through.
struct Recorder<'a, B: Backend> {
    kv: &'a mut ContiguousKv<B>,
    measured: &'a mut Measured,
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
        let (d, width) = (
            step.geometry.head_dim,
            step.geometry.num_kv_heads * step.geometry.head_dim,
        );
        let m = &mut *self.measured;
        let rotate = hadamard::supported(d);
        for (tensor, plain, rotated, is_k) in [
            (step.k, &mut m.k, &mut m.k_rotated, true),
            (step.v, &mut m.v, &mut m.v_rotated, false),
        ] {
            self.host.clear();
            backend.download_rows(tensor, rows.clone(), &mut self.host)?;
            plain[layer] = amax(plain[layer], &self.host);
            if is_k {
                let channels = &mut m.k_channels[layer];
                channels.resize(width, 0.0);
                for row in self.host.chunks_exact(width) {
                    for (c, x) in channels.iter_mut().zip(row) {
                        *c = c.max(x.abs());
                    }
                }
            }
            if rotate {
                hadamard::rotate(&mut self.host, d);
                rotated[layer] = amax(rotated[layer], &self.host);
            }
        }
        self.host.clear();
        backend.download_rows(step.q, rows.clone(), &mut self.host)?;
        let geometry = &step.geometry;
        let group = geometry.num_heads / geometry.num_kv_heads;
        let moment = &mut m.q_moment[layer];
        moment.resize(geometry.num_kv_heads * d * d, 0.0);
        for row in self.host.chunks_exact(geometry.num_heads * d) {
            for (h, q) in row.chunks_exact(d).enumerate() {
                let at = &mut moment[(h / group) * d * d..][..d * d];
                // The upper triangle only: all the file keeps (upper_means).
                for i in 0..d {
                    for j in i..d {
                        at[i * d + j] += f64::from(q[i]) * f64::from(q[j]);
                    }
                }
            }
        }
        if layer == 0 {
            m.q_count += rows.len() * group;
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

/// Runs `tokens` through `model` in windows of `window` tokens, recording every layer.
fn measure<B: Backend>(model: &Model<B>, tokens: &[u32], window: usize) -> Result<Measured> {
    let layers = model.config().num_layers;
    let rotate = hadamard::supported(model.config().head_dim);
    let per_layer = |on: bool| if on { vec![0.0f32; layers] } else { Vec::new() };
    let mut measured = Measured {
        k: per_layer(true),
        v: per_layer(true),
        k_channels: vec![Vec::new(); layers],
        k_rotated: per_layer(rotate),
        v_rotated: per_layer(rotate),
        q_moment: vec![Vec::new(); layers],
        q_count: 0,
    };
    let mut ws = model.workspace();
    let mut logits = Vec::new();
    for chunk in tokens.chunks(window) {
        let mut kv = model.new_kv(chunk.len());
        let mut recorder = Recorder {
            kv: &mut kv,
            measured: &mut measured,
            host: Vec::new(),
        };
        model.forward_batch(&mut ws, &[chunk], &mut recorder, Logits::None, &mut logits)?;
    }
    Ok(measured)
}

/// Runs `tokens` through `model` in windows of `window` tokens and records every layer's amax:
/// of K and V, of K's channels, and of both rotated; then once more with K smoothed by those
/// channels, for the amax of smoothed and rotated K.
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
    let plain = measure(&model.with_k_smoothing(None)?, tokens, window)?;
    let mut calibration = Calibration {
        source: source.to_string(),
        tokens: tokens.len(),
        k_amax: plain.k,
        v_amax: plain.v,
        k_channel_amax: plain.k_channels,
        hadamard: HadamardAmax {
            k_amax: plain.k_rotated,
            v_amax: plain.v_rotated,
            smoothed_k_amax: Vec::new(),
        },
        nvfp4_window: None,
        q_second_moment: upper_means(&plain.q_moment, plain.q_count, model.config().head_dim),
    };
    if !calibration.hadamard.k_amax.is_empty() {
        let smoothing = calibration.smoothing();
        let smoothed = measure(&model.with_k_smoothing(smoothing.as_ref())?, tokens, window)?;
        calibration.hadamard.smoothed_k_amax = smoothed.k_rotated;
    }
    Ok(calibration)
}

/// `R H R` for the normalized Hadamard matrix `R` (symmetric): rows rotated, then columns.
fn rotate_both_sides(h: &mut [f64], d: usize) {
    let mut m: Vec<f32> = Vec::new();
    for _ in 0..2 {
        m.clear();
        m.extend(h.iter().map(|v| *v as f32));
        hadamard::rotate(&mut m, d); // each row
        for i in 0..d {
            for j in 0..d {
                // transpose as it is written back, so the second pass rotates the columns
                h[j * d + i] = f64::from(m[i * d + j]);
            }
        }
    }
}

/// Each KV head's summed `q qᵀ` as the mean over `count` queries, upper triangle only.
fn upper_means(sums: &[Vec<f64>], count: usize, d: usize) -> Vec<Vec<f32>> {
    let n = count.max(1) as f64;
    sums.iter()
        .map(|layer| {
            layer
                .chunks_exact(d * d)
                .flat_map(|m| {
                    (0..d).flat_map(move |i| (i..d).map(move |j| (m[i * d + j] / n) as f32))
                })
                .collect()
        })
        .collect()
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
            hadamard: HadamardAmax::default(),
            nvfp4_window: None,
            q_second_moment: Vec::new(),
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
            hadamard: HadamardAmax::default(),
            nvfp4_window: None,
            q_second_moment: Vec::new(),
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
        // Smoothed K reaches 4 and 2 in its two layers: the scales follow.
        let smoothed = c.scales_for(KvDtype::Fp8, Some(&s), false).unwrap();
        assert_eq!(smoothed, scales_of(KvDtype::Fp8, &[4.0, 2.0], &c.v_amax));
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
    fn a_window_survives_the_file_and_applies_to_nvfp4_only() {
        let c = with_channels(vec![vec![1.0, 4.0], vec![2.0, 3.0]]);
        assert!(
            !c.to_json().unwrap().contains("nvfp4_window"),
            "absent unless named"
        );
        let windowed = Calibration {
            nvfp4_window: Some(64),
            ..c.clone()
        };
        let json = windowed.to_json().unwrap();
        assert!(json.contains("\"nvfp4_window\": 64"), "{json}");
        let read = Calibration::from_json(&json, 2).unwrap();
        assert_eq!(read, windowed);
        assert_eq!(read.window_for(KvDtype::Nvfp4), Some(64));
        assert_eq!(read.window_for(KvDtype::Fp8), None);
        assert_eq!(c.window_for(KvDtype::Nvfp4), None);
    }

    #[test]
    fn a_kv_config_takes_the_scales_of_what_its_cache_holds() {
        use crate::KvConfig;
        let c = with_channels(vec![vec![1.0, 4.0, 16.0], vec![2.0; 3]]);
        let kv = KvConfig::new(KvDtype::Nvfp4)
            .with_calibration(&c, true)
            .unwrap();
        let s = c.smoothing().unwrap();
        let smoothed = c.scales_for(KvDtype::Nvfp4, Some(&s), false).unwrap();
        assert_eq!(kv.scales, Some(smoothed));
        assert_eq!(kv.k_smoothing, Some(s));
        let plain = KvConfig::new(KvDtype::Fp8)
            .with_calibration(&c, false)
            .unwrap();
        assert_eq!(plain.scales, Some(c.scales(KvDtype::Fp8)));
        assert_eq!(plain.k_smoothing, None);
        // A file written before channels were measured does not smooth.
        let old = Calibration {
            k_channel_amax: Vec::new(),
            ..c.clone()
        };
        let kv = KvConfig::new(KvDtype::Nvfp4)
            .with_calibration(&old, true)
            .unwrap();
        assert_eq!(kv.k_smoothing, None);
        assert_eq!(kv.scales, Some(c.scales(KvDtype::Nvfp4)));
        // A rotated cache needs the amax of rotated vectors: smoothed then rotated K when
        // smoothing, rotated V always.
        let rotated = KvConfig {
            hadamard: true,
            ..KvConfig::new(KvDtype::Nvfp4)
        };
        let err = rotated.clone().with_calibration(&c, true).unwrap_err();
        assert!(err.to_string().contains("Hadamard-rotated"), "{err}");
        let measured = Calibration {
            hadamard: HadamardAmax {
                k_amax: vec![8.0, 1.5],
                v_amax: vec![0.5, 0.75],
                smoothed_k_amax: vec![3.0, 1.25],
            },
            ..c.clone()
        };
        let kv = rotated.clone().with_calibration(&measured, true).unwrap();
        let want = scales_of(KvDtype::Nvfp4, &[3.0, 1.25], &[0.5, 0.75]);
        assert_eq!(kv.scales, Some(want));
        let kv = rotated.with_calibration(&measured, false).unwrap();
        let want = scales_of(KvDtype::Nvfp4, &[8.0, 1.5], &[0.5, 0.75]);
        assert_eq!(kv.scales, Some(want));
        // And the file keeps them.
        let json = measured.to_json().unwrap();
        assert_eq!(Calibration::from_json(&json, 2).unwrap(), measured);
    }
}
