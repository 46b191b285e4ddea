use std::collections::BTreeMap;

use serde_json::json;

use super::*;
use crate::Change;

fn proposal() -> Proposal {
    Proposal {
        id: 8,
        roles: BTreeMap::from([
            ("decode-1".to_string(), Role::Decode),
            ("decode-2".to_string(), Role::Prefill),
            ("prefill-0".to_string(), Role::Prefill),
        ]),
        changes: vec![Change {
            worker: "decode-2".into(),
            from: Role::Decode,
            to: Role::Prefill,
        }],
        reason: Reason {
            ttft_p90_ms: 3100.0,
            itl_p90_ms: 41.0,
            slo_ttft_ms: 2000.0,
            slo_itl_ms: 100.0,
            queued_prefill_tokens: 5120,
            running_decodes: 12,
            waiting_decodes: 3,
            decode_pages_used: 700,
            decode_pages_total: 1000,
            prefill_workers: 1,
            decode_workers: 2,
            summary: "TTFT p90 3.1 s > SLO 2.0 s while ITL p90 41 ms < 80 ms: decode-2 → prefill"
                .into(),
        },
        desired: Desired {
            prefill: 2,
            decode: 1,
        },
    }
}

#[test]
fn keys_are_relative_to_the_store_root() {
    assert_eq!(LEADER_KEY, "planner/leader");
    assert_eq!(DECISION_KEY, "planner/decision");
    assert_eq!(DESIRED_KEY, "planner/desired");
    assert_eq!(HISTORY_KEY, "planner/history");
    assert_eq!(applied_key("decode-3"), "planner/applied/decode-3");
    assert!(applied_key("decode-3").starts_with(APPLIED_PREFIX));
}

#[test]
fn a_decision_is_written_with_stable_field_names() {
    let decision = Decision::from_proposal(&proposal(), "planner-a", 1_700_000_000_000);
    let json: serde_json::Value = serde_json::from_slice(&decision.to_json()).unwrap();
    assert_eq!(
        json,
        json!({
            "id": 8,
            "issued_unix_ms": 1_700_000_000_000u64,
            "leader": "planner-a",
            "roles": {"decode-1": "decode", "decode-2": "prefill", "prefill-0": "prefill"},
            "reason": {
                "ttft_p90_ms": 3100.0,
                "itl_p90_ms": 41.0,
                "slo_ttft_ms": 2000.0,
                "slo_itl_ms": 100.0,
                "queued_prefill_tokens": 5120,
                "running_decodes": 12,
                "waiting_decodes": 3,
                "decode_pages_used": 700,
                "decode_pages_total": 1000,
                "prefill_workers": 1,
                "decode_workers": 2,
                "summary": "TTFT p90 3.1 s > SLO 2.0 s while ITL p90 41 ms < 80 ms: decode-2 → prefill"
            },
            "desired": {"prefill": 2, "decode": 1}
        })
    );
    let known = ["decode-1", "decode-2", "prefill-0"];
    let (parsed, warnings) = Decision::parse(&decision.to_json(), &known).unwrap();
    assert_eq!(parsed, decision);
    assert_eq!(warnings, Vec::<String>::new());
    assert_eq!(parsed.role_of("decode-2"), Some(Role::Prefill));
    assert_eq!(parsed.role_of("decode-9"), None);
}

#[test]
fn a_hand_written_decision_keeps_only_valid_entries() {
    let written = br#"{
        "id": 12,
        "roles": {
            "decode-1": "prefill",
            "decode-2": "gpu",
            "ghost-7": "decode",
            "prefill-0": 3
        }
    }"#;
    let (decision, warnings) =
        Decision::parse(written, &["decode-1", "decode-2", "prefill-0"]).unwrap();
    assert_eq!(decision.id, 12);
    assert_eq!(
        decision.roles,
        BTreeMap::from([("decode-1".to_string(), Role::Prefill)])
    );
    // Left out by hand: read as empty.
    assert_eq!(decision.leader, "");
    assert_eq!(decision.issued_unix_ms, 0);
    assert_eq!(decision.reason, Reason::default());
    assert_eq!(decision.desired, Desired::default());
    assert_eq!(
        warnings,
        [
            "decision 12: worker \"decode-2\" has role \"gpu\", not prefill or decode; \
             the entry is ignored",
            "decision 12: worker \"ghost-7\" is not registered; its entry \"decode\" is ignored",
            "decision 12: worker \"prefill-0\" has role 3, not prefill or decode; \
             the entry is ignored",
        ]
    );
}

#[test]
fn a_malformed_decision_is_an_error_naming_what_is_wrong() {
    let not_json = Decision::parse(b"{\"id\": 3, \"roles\": ", &[]).unwrap_err();
    assert!(
        not_json
            .to_string()
            .starts_with("malformed planner decision: EOF while parsing"),
        "{not_json}"
    );
    let no_roles = Decision::parse(br#"{"id": 3}"#, &[]).unwrap_err();
    assert_eq!(
        no_roles.to_string(),
        "malformed planner decision: missing field `roles` at line 1 column 9"
    );
    let bad_id = Decision::parse(br#"{"id": "three", "roles": {}}"#, &[]).unwrap_err();
    assert!(
        bad_id
            .to_string()
            .contains("invalid type: string \"three\""),
        "{bad_id}"
    );
}

#[test]
fn leader_ack_and_desired_round_trip_with_their_field_names() {
    let leader = Leader {
        id: "planner-a".into(),
        since_unix_ms: 42,
    };
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&leader.to_json()).unwrap(),
        json!({"id": "planner-a", "since_unix_ms": 42})
    );
    assert_eq!(Leader::parse(&leader.to_json()).unwrap(), leader);

    let ack = Ack {
        decision: 8,
        worker: "decode-2".into(),
        role: Role::Decode,
        applied: false,
        detail: "pages still held by 3 requests after the drain deadline".into(),
    };
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&ack.to_json()).unwrap(),
        json!({
            "decision": 8,
            "worker": "decode-2",
            "role": "decode",
            "applied": false,
            "detail": "pages still held by 3 requests after the drain deadline"
        })
    );
    assert_eq!(Ack::parse(&ack.to_json()).unwrap(), ack);
    let bad_role = Ack::parse(
        br#"{"decision": 8, "worker": "d", "role": "gpu", "applied": true, "detail": ""}"#,
    )
    .unwrap_err();
    assert!(
        bad_role
            .to_string()
            .starts_with("malformed planner acknowledgement: unknown variant `gpu`"),
        "{bad_role}"
    );

    let desired = Desired {
        prefill: 2,
        decode: 5,
    };
    assert_eq!(desired.to_json(), br#"{"prefill":2,"decode":5}"#);
    assert_eq!(Desired::parse(&desired.to_json()).unwrap(), desired);
}
