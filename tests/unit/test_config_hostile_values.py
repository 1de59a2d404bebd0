"""Config values from issue 44's attack: a bad straggler factor is a config error (exit 78,
not a traceback), --check-config masks the metadata URL's password, a 120k-character job
name is quoted cut short, and loader variables in [workers.env] under workers.user warn."""

from __future__ import annotations

import pytest

from elasticd.config import load_config, render_effective, security_warnings
from elasticd.errors import EX_CONFIG, ConfigError

BASE = '[workers]\ncommand = ["train.py"]\n[job]\nname = "j"\n'


def config(tmp_path, text: str):
    path = tmp_path / "elasticd.toml"
    path.write_text(text)
    return load_config(str(path), {}, {})


@pytest.mark.timeout(30)
def test_a_straggler_factor_below_one_is_a_config_error(tmp_path):
    """straggler_factor = 0.5: ConfigError (exit 78) naming the key and the fix, not a ValueError."""
    with pytest.raises(ConfigError, match=r"rendezvous.straggler_factor = 0.5 .*above 1") as caught:
        config(tmp_path, BASE + "[rendezvous]\nstraggler_factor = 0.5\n")
    assert caught.value.exit_code == EX_CONFIG


@pytest.mark.timeout(30)
def test_check_config_masks_the_metadata_base_url_password(tmp_path):
    """preemption.base_url's userinfo is masked in the effective config --check-config prints."""
    cfg = config(tmp_path, BASE + '[preemption]\nbase_url = "http://u:hunter2@127.0.0.1:1/x"\n')
    text = render_effective(cfg)
    assert "hunter2" not in text and "base_url" in text
    assert cfg.preemption.base_url == "http://u:hunter2@127.0.0.1:1/x"  # used as given


@pytest.mark.timeout(30)
def test_a_huge_job_name_is_quoted_cut_short(tmp_path):
    """A 120,000-character job name: the error quotes it cut to ~80 characters with its length."""
    with pytest.raises(ConfigError) as caught:
        config(tmp_path, BASE.replace('"j"', '"' + "a" * 120_000 + '"'))
    message = str(caught.value)
    assert len(message) < 1000 and "120000 characters" in message


@pytest.mark.timeout(30)
def test_loader_variables_in_workers_env_warn_under_workers_user(tmp_path):
    """LD_PRELOAD in [workers.env] with workers.user set is named by security_warnings; not without."""
    env = '[workers.env]\nLD_PRELOAD = "/tmp/x.so"\n'
    plain = config(tmp_path, BASE + env)
    assert not any("LD_PRELOAD" in w for w in security_warnings(plain))
    text = BASE.replace("[job]", 'user = "nobody"\n[job]') + env
    as_user = config(tmp_path, text)
    assert any("workers.env.LD_PRELOAD" in w and "root" in w for w in security_warnings(as_user))


@pytest.mark.timeout(30)
def test_nnodes_in_other_scripts_digits_is_a_config_error(tmp_path):
    """nnodes = "١:٢" (Arabic-Indic digits, which int() reads as 1:2) is refused, naming the key."""
    shared = '[etcd]\nendpoints = ["http://127.0.0.1:2379"]\n'
    assert config(tmp_path, BASE + 'nnodes = "1:2"\n' + shared).job.max_nodes == 2
    with pytest.raises(ConfigError, match="job.nnodes .* not a node count"):
        config(tmp_path, BASE + 'nnodes = "\u0661:\u0662"\n' + shared)
