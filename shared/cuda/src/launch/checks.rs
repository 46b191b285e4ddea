//! The checks every safe launch makes before it writes: a page copy inside its pool and staging
//! buffer, quantize-on-write's K/V and slots inside the pool's pages.

use nibble_kvfmt::KvDtype;

use super::args::{NewKv, WindowRows};
use crate::{Error, PageGeom, Result};

/// Checks a page copy: pages of a multiple of 16 bytes, a pool of whole pages, every id one of
/// its pages, and a staging buffer of at least the listed pages (a pooled buffer may be larger).
pub(super) fn check_page_copy(
    staging: usize,
    pool: usize,
    page_ids: &[u32],
    page_bytes: usize,
) -> Result<()> {
    if page_bytes == 0 || !page_bytes.is_multiple_of(16) {
        return Err(Error::Unsupported(format!(
            "page copies need pages of a multiple of 16 bytes, not {page_bytes}"
        )));
    }
    let needed = page_ids.len() * page_bytes;
    if staging < needed {
        return Err(Error::Shape {
            what: "staging bytes (at least the pages copied)",
            expected: needed,
            actual: staging,
        });
    }
    let pages = pool / page_bytes;
    if let Some(bad) = page_ids.iter().find(|p| **p as usize >= pages) {
        return Err(Error::Shape {
            what: "page id below the pool's page count",
            expected: pages,
            actual: *bad as usize,
        });
    }
    Ok(())
}

/// Checks that the K and V of a quantize-on-write hold `n` tokens.
pub(super) fn check_new_kv(geom: &PageGeom, kv: &NewKv<'_>, n: usize) -> Result<()> {
    let values = n * (geom.kv_heads * geom.head_dim) as usize;
    check("K values", values, kv.k.len())?;
    check("V values", values, kv.v.len())?;
    if let Some(u) = &kv.k_codes {
        let d = geom.head_dim as usize;
        if !d.is_multiple_of(32) || d > 256 {
            return Err(Error::Unsupported(format!(
                "K codes chosen for the queries need a head dim that is a multiple of 32 up to 256, got {d}"
            )));
        }
        check("K codes' factors", geom.kv_heads as usize * d * d, u.len())?;
    }
    Ok(())
}

/// Checks that the recent windows of a quantize-on-write of `n` tokens cover them: whole
/// sequences of `rows_per_seq` tokens, a length and a table row for each, a window of the
/// pages' KV heads.
pub(super) fn check_window_rows(w: &WindowRows<'_>, n: usize, kv_heads: u32) -> Result<()> {
    if w.geom.kv_heads != kv_heads {
        return Err(Error::Shape {
            what: "KV heads of the window",
            expected: kv_heads as usize,
            actual: w.geom.kv_heads as usize,
        });
    }
    if !n.is_multiple_of(w.rows_per_seq) {
        return Err(Error::Shape {
            what: "tokens, a whole number of window sequences",
            expected: n.next_multiple_of(w.rows_per_seq),
            actual: n,
        });
    }
    let seqs = n / w.rows_per_seq;
    check("window sequence lengths", seqs, w.lens.len())?;
    check("window table", seqs * w.geom.pages as usize, w.table.len())
}

/// Checks that quantize-on-write stays inside a pool of `pool_bytes`: `geom` addresses `dtype`
/// head vectors within its pages (a power-of-two page size, parts that hold every head and token
/// of the dtype, the layer's K and V inside a page), and every slot is padding (`u32::MAX`) or
/// a slot of one of the pool's whole pages.
pub(crate) fn check_write_slots(
    pool_bytes: usize,
    geom: &PageGeom,
    dtype: KvDtype,
    slots: &[u32],
) -> Result<()> {
    let unsupported = |what: &str| Err(Error::Unsupported(format!("{what} ({geom:?})")));
    if !geom.page_size.is_power_of_two() || geom.page_shift != geom.page_size.trailing_zeros() {
        return unsupported("a page geometry whose page size is no power of two of its shift");
    }
    let d = geom.head_dim as usize;
    if (geom.data_bytes as usize, geom.scale_bytes as usize)
        != (dtype.data_bytes(d), dtype.scale_bytes(d))
    {
        return unsupported(&format!("a page geometry of another dtype than {dtype}"));
    }
    let vectors = geom.kv_heads as u64 * geom.page_size as u64;
    if vectors * u64::from(geom.data_bytes + geom.scale_bytes) > u64::from(geom.part_bytes) {
        return unsupported("a page geometry whose parts do not hold their head vectors");
    }
    let layer_end = (2 * u64::from(geom.layer) + 2) * u64::from(geom.part_bytes);
    if geom.page_bytes == 0 || layer_end > geom.page_bytes {
        return Err(Error::Shape {
            what: "page bytes covering the layer's K and V (at least)",
            expected: layer_end as usize,
            actual: geom.page_bytes as usize,
        });
    }
    let pages = pool_bytes as u64 / geom.page_bytes;
    let bad = slots
        .iter()
        .find(|&&s| s != u32::MAX && u64::from(s >> geom.page_shift) >= pages);
    if let Some(&slot) = bad {
        return Err(Error::Shape {
            what: "page of a slot (below the pool's page count)",
            expected: pages as usize,
            actual: (slot >> geom.page_shift) as usize,
        });
    }
    Ok(())
}

pub(crate) fn check(what: &'static str, expected: usize, actual: usize) -> Result<()> {
    if expected == actual {
        Ok(())
    } else {
        Err(Error::Shape {
            what,
            expected,
            actual,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::launch::page_copy_grid;

    #[test]
    fn page_copies_are_checked_before_launch() {
        assert!(
            check_page_copy(32, 128, &[1, 0, 7], 16).is_err(),
            "id 7 of 8 pages is fine, staging is short"
        );
        assert!(check_page_copy(48, 128, &[1, 0, 7], 16).is_ok());
        assert!(
            check_page_copy(64, 128, &[1, 0, 7], 16).is_ok(),
            "a larger pooled buffer holds the pages in its first bytes"
        );
        assert!(
            check_page_copy(48, 128, &[1, 0, 8], 16).is_err(),
            "page 8 is past the pool"
        );
        assert!(
            check_page_copy(30, 60, &[0, 1], 15).is_err(),
            "15-byte pages"
        );
        assert!(check_page_copy(0, 128, &[], 16).is_ok());
        let grid = page_copy_grid(100_000, 103_680);
        assert_eq!(grid.grid_dim.1, 65_535);
        assert_eq!(grid.grid_dim.0, 26);
    }

    /// The geometry of layer `layer` of 4-layer pages of 16 tokens, 2 KV heads of 64.
    fn geom(dtype: KvDtype, layer: usize) -> PageGeom {
        let layout = nibble_kvfmt::PageLayout::new(4, 2, 64, 16, dtype).unwrap();
        PageGeom::new(&layout, layer).unwrap()
    }

    #[test]
    fn quantize_slots_are_checked_before_launch() {
        for dtype in [KvDtype::Nvfp4, KvDtype::Fp8, KvDtype::Bf16] {
            let g = geom(dtype, 3);
            let pool = 8 * g.page_bytes as usize;
            let last = 8 * 16 - 1;
            assert!(check_write_slots(pool, &g, dtype, &[0, 17, last, u32::MAX]).is_ok());
            assert!(check_write_slots(pool, &g, dtype, &[]).is_ok());
            let err = check_write_slots(pool, &g, dtype, &[3, last + 1]).unwrap_err();
            assert!(
                matches!(
                    err,
                    Error::Shape {
                        expected: 8,
                        actual: 8,
                        ..
                    }
                ),
                "slot {} is on page 8 of 8: {err}",
                last + 1
            );
            assert!(check_write_slots(pool, &g, dtype, &[u32::MAX - 1]).is_err());
            // A pool of 7.5 pages has 7 whole ones.
            let short = pool - g.page_bytes as usize / 2;
            assert!(check_write_slots(short, &g, dtype, &[7 * 16]).is_err());
            assert!(check_write_slots(short, &g, dtype, &[7 * 16 - 1]).is_ok());
        }
    }

    #[test]
    fn quantize_geometry_is_checked_before_launch() {
        let g = geom(KvDtype::Fp8, 3);
        let ok = |g: &PageGeom, dtype| check_write_slots(1 << 20, g, dtype, &[0]).is_ok();
        assert!(ok(&g, KvDtype::Fp8));
        // Another dtype's vectors are larger (bf16) or laid out otherwise (nvfp4).
        assert!(!ok(&g, KvDtype::Bf16));
        assert!(!ok(&g, KvDtype::Nvfp4));
        let layer = PageGeom { layer: 4, ..g };
        assert!(!ok(&layer, KvDtype::Fp8), "a layer past the page");
        let parts = PageGeom {
            part_bytes: g.part_bytes - 16,
            ..g
        };
        assert!(
            !ok(&parts, KvDtype::Fp8),
            "parts too small for their vectors"
        );
        let shift = PageGeom { page_shift: 3, ..g };
        assert!(
            !ok(&shift, KvDtype::Fp8),
            "a shift that is not the page size's"
        );
        let empty = PageGeom { page_bytes: 0, ..g };
        assert!(!ok(&empty, KvDtype::Fp8));
    }
}
