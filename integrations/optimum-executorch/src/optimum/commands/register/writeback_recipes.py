"""Imported by optimum-cli at start (optimum's ``optimum.commands.register`` namespace):
registers writeback's recipes in optimum-executorch's recipe registry. No command is added."""

from writeback_optimum import register

register()

REGISTER_COMMANDS: list[object] = []
