//! `sluice operator` started where no cluster can be found says why once, with what to do.

#[test]
fn without_a_kubeconfig_the_operator_names_its_cause_once() {
    let home = tempfile::tempdir().unwrap();
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_sluice"))
        .args(["operator", "--listen", "127.0.0.1:0"])
        .env_remove("KUBERNETES_SERVICE_HOST")
        .env_remove("KUBERNETES_SERVICE_PORT")
        .env("KUBECONFIG", home.path().join("absent-kubeconfig"))
        .env("HOME", home.path())
        .output()
        .unwrap();
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    let errors: Vec<&str> = stderr.lines().filter(|l| l.starts_with("Error:") || l.contains("caused by:")).collect();
    assert_eq!(errors.len(), 1, "one line for one cause:\n{stderr}");
    assert!(errors[0].contains("absent-kubeconfig") && errors[0].contains("KUBECONFIG"), "{stderr}");
}
