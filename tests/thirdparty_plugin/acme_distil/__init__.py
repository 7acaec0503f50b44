"""acme-distil: a mopt plugin written only against `mopt.api` and `mopt.hookspecs`."""
