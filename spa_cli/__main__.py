from spa_cli.main import app

app(prog_name="spa")
