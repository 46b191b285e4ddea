use super::*;
use clap::Parser;
use nibble_engine::calibrate::Calibration;
use nibble_engine::calibrate::HadamardAmax;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    worker: WorkerArgs,
}

fn args(extra: &[&str]) -> std::result::Result<WorkerArgs, clap::Error> {
    let argv = ["worker", "--model", "m.gguf", "--listen", "127.0.0.1:0"];
    Cli::try_parse_from(argv.iter().chain(extra)).map(|c| c.worker)
}

const GIB: usize = 1 << 30;

fn gpu(free_gib: usize, total_gib: usize) -> Option<DeviceMemory> {
    Some(DeviceMemory {
        free: free_gib * GIB,
        total: total_gib * GIB,
    })
}

#[test]
fn the_library_defaults_are_the_flags_defaults() {
    let flags = args(&[]).unwrap().config();
    let library = WorkerConfig::new(flags.model.clone());
    assert_eq!(format!("{library:?}"), format!("{flags:?}"));
}

#[test]
fn kv_flags_reach_the_cache_config() {
    let kv = kv_config(&args(&[]).unwrap().config(), 2, 64).unwrap();
    assert_eq!((kv.dtype, kv.page_size), (KvDtype::Nvfp4, 16));
    assert_eq!(kv.scale_rule, ScaleRule::Mse);
    assert!(kv.scales.is_none() && !kv.hadamard);
    assert_eq!(kv.window, 48, "nvfp4's default window");
    let kv = kv_config(&args(&["--page-size", "32"]).unwrap().config(), 2, 64).unwrap();
    assert_eq!(kv.window, 64, "the default window in whole pages of 32");
    let fp8 = kv_config(&args(&["--kv-dtype", "fp8"]).unwrap().config(), 2, 64).unwrap();
    assert_eq!(fp8.window, 0);
    let kv = kv_config(&args(&["--kv-window", "32"]).unwrap().config(), 2, 64).unwrap();
    assert_eq!(kv.window, 32);
    let err = kv_config(&args(&["--kv-window", "40"]).unwrap().config(), 2, 64).unwrap_err();
    assert_eq!(
        err.to_string(),
        "--kv-window 40: not a multiple of the page size (16)"
    );
    assert_eq!(
        kv_config(&args(&[]).unwrap().config(), 2, 64)
            .unwrap()
            .work(),
        WorkDtype::Bf16
    );
    let kv = kv_config(&args(&["--prefill-work", "fp8"]).unwrap().config(), 2, 64).unwrap();
    assert_eq!(kv.work(), WorkDtype::Fp8);
    let bf16 = args(&["--kv-dtype", "bf16", "--prefill-work", "fp8"]).unwrap();
    let err = kv_config(&bf16.config(), 2, 64).unwrap_err();
    assert!(err
        .to_string()
        .contains("--prefill-work fp8: needs an fp8 or nvfp4 cache"));
    assert!(args(&["--prefill-work", "fp16"]).is_err());

    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("calibration.json");
    let calibration = Calibration {
        source: "test".into(),
        tokens: 8,
        k_amax: vec![12.0, 24.0],
        v_amax: vec![3.0, 6.0],
        k_channel_amax: Vec::new(),
        hadamard: HadamardAmax {
            k_amax: vec![6.0, 12.0],
            v_amax: vec![1.5, 3.0],
            smoothed_k_amax: Vec::new(),
        },
        nvfp4_window: None,
        q_second_moment: Vec::new(),
    };
    std::fs::write(&file, calibration.to_json().unwrap()).unwrap();
    let path = file.to_str().unwrap();
    let flags = [
        "--kv-dtype",
        "fp8",
        "--scale-rule",
        "amax",
        "--hadamard",
        "--calibration",
    ];
    let a = args(&[&flags[..], &[path]].concat());
    let kv = kv_config(&a.unwrap().config(), 2, 64).unwrap();
    assert_eq!(kv.scale_rule, ScaleRule::Amax);
    assert!(kv.hadamard);
    // Rotated vectors' scales for a rotated cache.
    let rotated = calibration.scales_for(KvDtype::Fp8, None, true).unwrap();
    assert_eq!(kv.scales, Some(rotated));
    let unrotated = Calibration {
        hadamard: HadamardAmax::default(),
        ..calibration.clone()
    };
    let old = dir.path().join("old.json");
    std::fs::write(&old, unrotated.to_json().unwrap()).unwrap();
    let a = args(&[&flags[..], &[old.to_str().unwrap()]].concat());
    let err = kv_config(&a.unwrap().config(), 2, 64)
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("--calibration") && err.contains("Hadamard-rotated"),
        "{err}"
    );

    // A file for another layer count, a missing file and an unknown rule name what is wrong.
    let err = kv_config(&args(&["--calibration", path]).unwrap().config(), 3, 64).unwrap_err();
    assert!(
        err.to_string().contains("--calibration") && err.to_string().contains("3 layers"),
        "{err}"
    );
    let err = kv_config(
        &args(&["--calibration", "/nonexistent.json"])
            .unwrap()
            .config(),
        2,
        64,
    )
    .unwrap_err();
    assert!(err.to_string().contains("/nonexistent.json"), "{err}");
    let err = args(&["--scale-rule", "max"]).unwrap_err().to_string();
    assert!(err.contains("amax or mse"), "{err}");

    // With the queries' second moment, an nvfp4 cache chooses K's codes for them unless
    // --no-k-codes; an fp8 cache never does; a moment of another head dim is refused.
    let d = 4;
    let tri: Vec<f32> = (0..d)
        .flat_map(|i| (i..d).map(move |j| if i == j { 2.0 } else { 0.5 }))
        .collect();
    let with_moment = Calibration {
        hadamard: HadamardAmax::default(),
        q_second_moment: vec![tri.repeat(3), tri.repeat(3)],
        ..calibration.clone()
    };
    let file = dir.path().join("queries.json");
    std::fs::write(&file, with_moment.to_json().unwrap()).unwrap();
    let path = file.to_str().unwrap();
    let kv = |flags: &[&str], head_dim| {
        let a = args(&[flags, &["--calibration", path]].concat()).unwrap();
        kv_config(&a.config(), 2, head_dim)
    };
    let factors = kv(&[], d).unwrap().k_codes.expect("K codes");
    assert_eq!((factors.layers(), factors.kv_heads()), (2, 3));
    assert!(kv(&["--no-k-codes"], d).unwrap().k_codes.is_none());
    assert!(kv(&["--kv-dtype", "fp8"], d).unwrap().k_codes.is_none());
    let err = kv(&[], 8).unwrap_err().to_string();
    assert!(
        err.contains("--calibration") && err.contains("8 x 8"),
        "{err}"
    );
    let err = args(&["--scale-rule", "max"]).unwrap_err().to_string();
    assert!(err.contains("amax or mse"), "{err}");

    // A calibration that names its model's nvfp4 window sets it unless --kv-window does.
    let windowed = |tokens: usize| {
        let file = dir.path().join(format!("window-{tokens}.json"));
        let c = Calibration {
            nvfp4_window: Some(tokens),
            ..calibration.clone()
        };
        std::fs::write(&file, c.to_json().unwrap()).unwrap();
        file.to_str().unwrap().to_string()
    };
    let w64 = windowed(64);
    let kv = kv_config(&args(&["--calibration", &w64]).unwrap().config(), 2, 64).unwrap();
    assert_eq!(kv.window, 64, "the calibration's window");
    let a = args(&["--calibration", &w64, "--kv-window", "32"]).unwrap();
    assert_eq!(
        kv_config(&a.config(), 2, 64).unwrap().window,
        32,
        "the flag wins"
    );
    let a = args(&["--calibration", &w64, "--kv-dtype", "fp8"]).unwrap();
    assert_eq!(
        kv_config(&a.config(), 2, 64).unwrap().window,
        0,
        "nvfp4 only"
    );
    let w40 = windowed(40);
    let err = kv_config(&args(&["--calibration", &w40]).unwrap().config(), 2, 64).unwrap_err();
    assert_eq!(
        err.to_string(),
        format!("--calibration {w40}: nvfp4_window 40: not a multiple of the page size (16)")
    );
}

#[test]
fn an_explicit_budget_wins_on_either_device() {
    let a = args(&["--kv-budget-mib", "1000"]).unwrap();
    assert_eq!(kv_budget_bytes(&a.config(), None).unwrap(), 1000 << 20);
    assert_eq!(
        kv_budget_bytes(&a.config(), gpu(80, 100)).unwrap(),
        1000 << 20
    );
}

#[test]
fn without_a_budget_the_cpu_takes_256_mib_and_a_gpu_its_share() {
    let a = args(&[]).unwrap();
    assert_eq!(a.kv_memory_fraction, 0.9);
    assert_eq!(kv_budget_bytes(&a.config(), None).unwrap(), 256 << 20);
    // 90% of 100 GiB, but only 80 GiB are free: all of it less the 10 GiB reserve.
    assert_eq!(
        kv_budget_bytes(&a.config(), gpu(80, 100)).unwrap(),
        70 * GIB
    );
    let a = args(&["--kv-memory-fraction", "0.5"]).unwrap();
    assert_eq!(
        kv_budget_bytes(&a.config(), gpu(80, 100)).unwrap(),
        50 * GIB
    );
}

#[test]
fn two_workers_sharing_a_gpu_get_their_shares_in_either_order() {
    // nibble up's fractions on a 100 GiB GPU, a 1 GiB model loaded by each worker.
    let total = 100;
    let prefill = args(&["--kv-memory-fraction", "0.25"]).unwrap();
    let decode = args(&["--kv-memory-fraction", "0.6"]).unwrap();
    for first_is_prefill in [true, false] {
        let (first, second) = if first_is_prefill {
            (&prefill, &decode)
        } else {
            (&decode, &prefill)
        };
        let a = kv_budget_bytes(&first.config(), gpu(total - 1, total)).unwrap();
        let free = total * GIB - GIB - a - GIB;
        let memory = Some(DeviceMemory {
            free,
            total: total * GIB,
        });
        let b = kv_budget_bytes(&second.config(), memory).unwrap();
        let (p, d) = if first_is_prefill { (a, b) } else { (b, a) };
        assert_eq!(
            (p, d),
            (25 * GIB, 60 * GIB),
            "prefill first: {first_is_prefill}"
        );
    }
}

#[test]
fn a_gpu_with_nothing_left_is_an_error_that_says_what_to_do() {
    let a = args(&[]).unwrap();
    let e = kv_budget_bytes(&a.config(), gpu(4, 100))
        .unwrap_err()
        .to_string();
    assert!(e.contains("--kv-budget-mib"), "{e}");
    assert!(e.contains("4096 MiB free of 102400 MiB"), "{e}");
}

#[test]
fn an_internal_api_beyond_loopback_needs_a_token_mtls_or_the_opt_out() {
    use nibble_security::Secret;
    let open = nibble_security::Security::default();
    let token = nibble_security::Security {
        internal_token: Secret::new("t"),
        ..Default::default()
    };
    let at = |s: &str| s.parse::<SocketAddr>().unwrap();
    for loopback in [
        "127.0.0.1:50061",
        "127.0.0.9:0",
        "[::1]:0",
        "[::ffff:127.0.0.1]:0",
    ] {
        assert!(check_exposure("--listen", at(loopback), &open, false).is_ok());
    }
    for exposed in [
        "0.0.0.0:50061",
        "[::]:0",
        "10.0.0.7:50061",
        "[::ffff:10.0.0.7]:0",
    ] {
        let e = check_exposure("--listen", at(exposed), &open, false)
            .unwrap_err()
            .to_string();
        assert!(e.starts_with(&format!("--listen {}", at(exposed))), "{e}");
        for flag in [
            "--internal-token",
            "--tls-cert",
            "--tls-ca",
            "--allow-unauthenticated-internal",
        ] {
            assert!(e.contains(flag), "{e}");
        }
        assert!(check_exposure("--listen", at(exposed), &token, false).is_ok());
        assert!(check_exposure("--listen", at(exposed), &open, true).is_ok());
    }
    // An empty token is no token.
    let empty = nibble_security::SecurityArgs {
        internal_token: Some(String::new()),
        ..Default::default()
    };
    let e = check_exposure("--listen", at("0.0.0.0:1"), &empty.load().unwrap(), false);
    assert!(e.is_err());
    let flags = args(&["--allow-unauthenticated-internal"]).unwrap();
    assert!(flags.config().allow_unauthenticated_internal);
}

#[test]
fn the_fraction_must_lie_in_zero_to_one() {
    for bad in ["0", "1.5", "-0.1", "half", "NaN"] {
        let flag = format!("--kv-memory-fraction={bad}");
        let e = args(&[flag.as_str()]).expect_err(bad);
        assert!(e.to_string().contains("not a fraction in (0, 1]"), "{e}");
    }
    assert_eq!(
        args(&["--kv-memory-fraction", "1"])
            .unwrap()
            .kv_memory_fraction,
        1.0
    );
}
