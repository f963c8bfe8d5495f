"""tox inline plugin: `host_site_packages = true` runs an environment on the interpreter that runs
tox, with that interpreter's own site-packages, venv or not.

tox's `system_site_packages` exposes the *base* interpreter's packages; where torch lives in a
virtualenv (a GPU host's image, a conda env) that is the wrong set. This writes a `.pth` file into
the environment listing the site-packages of the interpreter running tox, before the commands.
"""

from __future__ import annotations

import site
import sys
from pathlib import Path

from tox.plugin import impl

PTH = "_vllm_sparse_sync_host_site.pth"


def host_site_dirs() -> list[str]:
    """site-packages of the interpreter running tox (its venv's, where it runs in one)."""
    dirs = list(site.getsitepackages())
    user = site.getusersitepackages()
    if site.ENABLE_USER_SITE and isinstance(user, str):
        dirs.append(user)
    return [d for d in dict.fromkeys(dirs) if Path(d).is_dir()]


@impl
def tox_add_env_config(env_conf, state):
    env_conf.add_config(keys=["host_site_packages"], of_type=bool, default=False,
                        desc="expose the site-packages of the interpreter running tox (venv or not)")


@impl
def tox_before_run_commands(tox_env):
    if not tox_env.conf["host_site_packages"]:
        return
    target = Path(tox_env.conf["env_site_packages_dir"])
    target.mkdir(parents=True, exist_ok=True)
    (target / PTH).write_text("\n".join(host_site_dirs()) + "\n")
    print(f"{tox_env.name}: host site-packages of {sys.executable} exposed through {target / PTH}")
