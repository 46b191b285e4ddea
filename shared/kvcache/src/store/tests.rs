use nibble_kvfmt::{bf16, interchange, nvfp4, KvDtype, KvPart, PageLayout, ScaleRule};

use super::*;

fn layout(dtype: KvDtype) -> PageLayout {
    PageLayout::new(2, 2, 32, 4, dtype).unwrap()
}

fn pool(dtype: KvDtype, pages: usize) -> (PagePool, HostPages) {
    pool_with(dtype, pages, ScaleRule::Amax)
}

fn pool_with(dtype: KvDtype, pages: usize, rule: ScaleRule) -> (PagePool, HostPages) {
    let plan = PoolPlan::for_pages(layout(dtype), pages).unwrap();
    (
        PagePool::new(plan),
        HostPages::new(plan, GlobalScales::ones(2), rule).unwrap(),
    )
}

#[test]
fn write_rejects_duplicates_and_free_pages_and_writes_nothing() {
    let (mut pool, mut store) = pool(KvDtype::Nvfp4, 3);
    let pages = pool.alloc(1).unwrap();
    let values = vec![1.0f32; 2 * 64];
    let s0 = SlotId::new(pages[0], 0, 4);
    let s1 = SlotId::new(pages[0], 1, 4);
    let err = store
        .write_kv(&pool, 0, &values, &values, &[Some(s0), Some(s0)])
        .unwrap_err();
    assert_eq!(err, Error::DuplicateSlot(s0));
    let free_slot = SlotId::new(PageId(2), 0, 4);
    let err = store
        .write_kv(&pool, 0, &values, &values, &[Some(s1), Some(free_slot)])
        .unwrap_err();
    assert_eq!(err, Error::NotAllocated(PageId(2)));
    assert!(store.page(pages[0]).unwrap().iter().all(|b| *b == 0));
    let err = store.write_kv(&pool, 5, &values, &values, &[Some(s0), Some(s1)]);
    assert!(matches!(err, Err(Error::LayerOutOfRange { .. })));
    let err = store.write_kv(&pool, 0, &values[..64], &values, &[Some(s0), Some(s1)]);
    assert!(matches!(err, Err(Error::BadLength { .. })));
}

#[test]
fn padding_slots_are_skipped() {
    let (mut pool, mut store) = pool(KvDtype::Bf16, 2);
    let page = pool.alloc(1).unwrap()[0];
    let k: Vec<f32> = (0..3 * 64).map(|i| i as f32).collect();
    let v: Vec<f32> = k.iter().map(|x| -x).collect();
    let slot = SlotId::new(page, 2, 4);
    store
        .write_kv(&pool, 1, &k, &v, &[None, Some(slot), None])
        .unwrap();
    let mut out = vec![0.0f32; 32];
    store.read_head(1, KvPart::K, slot, 1, &mut out).unwrap();
    let expected: Vec<f32> = (96..128).map(|i| i as f32).collect();
    assert_eq!(out, expected, "token 1, head 1");
    store.read_head(1, KvPart::V, slot, 0, &mut out).unwrap();
    assert_eq!(out[0], -64.0);
    // Other slots of the page stay zero.
    store
        .read_head(1, KvPart::K, SlotId::new(page, 0, 4), 0, &mut out)
        .unwrap();
    assert!(out.iter().all(|x| *x == 0.0));
}

#[test]
fn nvfp4_page_bytes_match_the_interchange_encoding() {
    let (mut pool, mut store) = pool(KvDtype::Nvfp4, 1);
    let page = pool.alloc(1).unwrap()[0];
    let k: Vec<f32> = (0..64).map(|i| (i as f32 * 0.37).sin() * 3.0).collect();
    let v: Vec<f32> = k.iter().map(|x| x * 0.5 + 0.1).collect();
    let slot = SlotId::new(page, 3, 4);
    store.write_kv(&pool, 0, &k, &v, &[Some(slot)]).unwrap();
    let layout = *store.layout();
    let bytes = store.page(page).unwrap();
    for (part, x) in [(KvPart::K, &k), (KvPart::V, &v)] {
        for head in 0..2 {
            let expected =
                interchange::encode(KvDtype::Nvfp4, 32, 1.0, &x[head * 32..(head + 1) * 32])
                    .unwrap();
            let d = layout.data_offset(0, part, head, 3);
            let s = layout.scale_offset(0, part, head, 3);
            assert_eq!(&bytes[d..d + 16], &expected[..16]);
            assert_eq!(&bytes[s..s + 2], &expected[16..]);
        }
    }
}

#[test]
fn nvfp4_pages_are_written_under_the_stores_scale_rule() {
    let k: Vec<f32> = (0..64).map(|i| (i as f32 * 0.61).cos() * 2.5).collect();
    let v: Vec<f32> = k.iter().map(|x| x * -0.3).collect();
    let mut pages = Vec::new();
    for rule in ScaleRule::ALL {
        let (mut pool, mut store) = pool_with(KvDtype::Nvfp4, 1, rule);
        assert_eq!(store.scale_rule(), rule);
        let page = pool.alloc(1).unwrap()[0];
        let slot = SlotId::new(page, 1, 4);
        store.write_kv(&pool, 0, &k, &v, &[Some(slot)]).unwrap();
        let layout = *store.layout();
        let bytes = store.page(page).unwrap().to_vec();
        for (part, x) in [(KvPart::K, &k), (KvPart::V, &v)] {
            for head in 0..2 {
                let (mut packed, mut scales) = ([0u8; 16], [0u8; 2]);
                let hx = &x[head * 32..(head + 1) * 32];
                nvfp4::quantize_with(hx, 1.0, rule, &mut packed, &mut scales).unwrap();
                let d = layout.data_offset(0, part, head, 1);
                let s = layout.scale_offset(0, part, head, 1);
                assert_eq!(&bytes[d..d + 16], &packed, "{rule} {part:?} head {head}");
                assert_eq!(&bytes[s..s + 2], &scales, "{rule} {part:?} head {head}");
            }
        }
        pages.push(bytes);
    }
    assert_ne!(
        pages[0], pages[1],
        "the two rules choose some scale differently here"
    );
}

#[test]
fn k_codes_are_written_for_the_queries_and_v_as_before() {
    use nibble_kvfmt::nvfp4::feedback::quantize_for_queries;
    let k: Vec<f32> = (0..64).map(|i| (i as f32 * 0.61).cos() * 2.5).collect();
    let v: Vec<f32> = k.iter().map(|x| x * -0.3).collect();
    let factors = Arc::new(KeyFactors::mixing(2, 2, 32, 0));
    let (mut pool, store) = pool_with(KvDtype::Nvfp4, 1, ScaleRule::Mse);
    let mut store = store.with_k_codes(Some(factors.clone())).unwrap();
    let page = pool.alloc(1).unwrap()[0];
    let slot = SlotId::new(page, 2, 4);
    store.write_kv(&pool, 1, &k, &v, &[Some(slot)]).unwrap();
    let layout = *store.layout();
    let bytes = store.page(page).unwrap();
    let mut differs = false;
    for (part, x) in [(KvPart::K, &k), (KvPart::V, &v)] {
        for head in 0..2 {
            let (mut packed, mut scales) = ([0u8; 16], [0u8; 2]);
            let hx = &x[head * 32..(head + 1) * 32];
            nvfp4::quantize_with(hx, 1.0, ScaleRule::Mse, &mut packed, &mut scales).unwrap();
            let plain = packed;
            if part == KvPart::K {
                let f = factors.get(1, head);
                quantize_for_queries(hx, 1.0, ScaleRule::Mse, f, &mut packed, &mut scales);
                differs |= packed != plain;
            }
            let d = layout.data_offset(1, part, head, 2);
            let s = layout.scale_offset(1, part, head, 2);
            assert_eq!(&bytes[d..d + 16], &packed, "{part:?} head {head}");
            assert_eq!(&bytes[s..s + 2], &scales, "{part:?} head {head}");
        }
    }
    assert!(differs, "some key's codes are chosen differently");
}

#[test]
fn k_codes_that_do_not_fit_the_pool_are_refused() {
    let factors = Arc::new(KeyFactors::mixing(2, 2, 32, 0));
    let (_, store) = pool(KvDtype::Fp8, 1);
    let err = store.with_k_codes(Some(factors.clone())).unwrap_err();
    assert!(err.to_string().contains("fp8 cache"), "{err}");
    let (_, store) = pool(KvDtype::Nvfp4, 1);
    let wrong = Arc::new(KeyFactors::mixing(3, 2, 32, 0));
    let err = store.with_k_codes(Some(wrong)).unwrap_err();
    assert!(
        err.to_string().contains("2 layers x 2 KV heads x 32"),
        "{err}"
    );
    assert!(err.to_string().contains("3 x 2 x 32"), "{err}");
}

#[test]
fn scales_are_validated() {
    let plan = PoolPlan::for_pages(layout(KvDtype::Fp8), 1).unwrap();
    let mut scales = GlobalScales::ones(2);
    scales.v[1] = f32::NAN;
    let err = HostPages::new(plan, scales, ScaleRule::Mse).unwrap_err();
    assert!(err.to_string().contains("V scale of layer 1"), "{err}");
    assert!(HostPages::new(plan, GlobalScales::ones(3), ScaleRule::Mse).is_err());
}

#[test]
fn the_window_holds_the_last_tokens_in_bf16() {
    // 2 layers x 2 heads x 32 dims, pages of 4 tokens: a window of 4 tokens.
    let plan = PoolPlan::for_pages(layout(KvDtype::Nvfp4), 8).unwrap();
    let mut pool = PagePool::new(plan);
    let mut store = HostPages::new(plan, GlobalScales::ones(2), ScaleRule::Mse)
        .unwrap()
        .with_window(4)
        .unwrap();
    let window = *store.window();
    let pages = pool.alloc(window.pages()).unwrap();
    // Six tokens written one step at a time, as decode does: the window keeps tokens 2..6.
    let token = |t: usize, part: f32| -> Vec<f32> {
        (0..64)
            .map(|i| part * (t as f32 + i as f32 / 64.0))
            .collect()
    };
    for t in 0..6 {
        let (k, v) = (token(t, 1.0), token(t, -1.0));
        store
            .write_window(&pool, &pages, 1, &k, &v, t..t + 1, t + 1)
            .unwrap();
    }
    let mut out = vec![0.0f32; 32];
    for t in 2..6 {
        assert!(window.holds(t, 6));
        let bytes = store.window_head(&pages, 1, KvPart::V, 1, t).unwrap();
        bf16::decode_le(bytes, &mut out);
        let expected: Vec<f32> = token(t, -1.0)[32..]
            .iter()
            .map(|x| bf16::round(*x))
            .collect();
        assert_eq!(out, expected, "token {t}");
    }
    // A prefill of 6 tokens writes only the last 4: the same bytes.
    let mut again = HostPages::new(plan, GlobalScales::ones(2), ScaleRule::Mse)
        .unwrap()
        .with_window(4)
        .unwrap();
    let k: Vec<f32> = (0..6).flat_map(|t| token(t, 1.0)).collect();
    let v: Vec<f32> = (0..6).flat_map(|t| token(t, -1.0)).collect();
    again
        .write_window(&pool, &pages, 1, &k, &v, 0..6, 6)
        .unwrap();
    for p in &pages {
        assert_eq!(again.page(*p).unwrap(), store.page(*p).unwrap());
    }
    // Window pages must be the window's count and allocated; nothing is written otherwise.
    let err = store
        .write_window(&pool, &pages[..0], 1, &k[..64], &v[..64], 6..7, 7)
        .unwrap_err();
    assert!(
        matches!(
            err,
            Error::BadLength {
                what: "window pages",
                ..
            }
        ),
        "{err}"
    );
    pool.release_all(&pages).unwrap();
    let err = store
        .write_window(&pool, &pages, 1, &k[..64], &v[..64], 6..7, 7)
        .unwrap_err();
    assert!(matches!(err, Error::NotAllocated(_)), "{err}");
    // Not a multiple of the page size.
    let err = HostPages::new(plan, GlobalScales::ones(2), ScaleRule::Mse)
        .unwrap()
        .with_window(6)
        .unwrap_err();
    assert!(
        err.to_string().contains("not a multiple of the page size"),
        "{err}"
    );
}
