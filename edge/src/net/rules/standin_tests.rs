use super::*;

#[test]
fn a_proxied_sandboxs_chain_lets_its_stand_ins_through_to_the_relay_and_nothing_else() {
    let addrs = [Ipv4Addr::new(198, 18, 0, 1), Ipv4Addr::new(198, 18, 0, 2)];
    let place = SandboxPlace {
        table: "t",
        slot: 3,
        veth: "odx3",
        v4: Ipv4Addr::new(10, 231, 0, 3),
        v6: None,
        standins: Some(&addrs),
    };
    let text = sandbox_script(&place, &Policy::default(), 7, &BTreeSet::new());
    assert!(text.contains("add set inet t d3_standin_4 { type ipv4_addr; }\nflush set inet t d3_standin_4\n"));
    assert!(text.contains("add element inet t d3_standin_4 { 198.18.0.1, 198.18.0.2 }"));
    let accept = text
        .find("ip daddr @d3_standin_4 meta l4proto tcp ct mark set 0x7 accept")
        .unwrap();
    assert!(accept < text.find("default: ").unwrap(), "before the default refusal");
    // The stand-ins lie in special space: nothing else reaches them.
    assert!(is_special(IpAddr::V4(addrs[0])));
    let none = SandboxPlace {
        standins: None,
        ..place
    };
    assert!(!sandbox_script(&none, &Policy::default(), 7, &BTreeSet::new()).contains("standin"));
}
