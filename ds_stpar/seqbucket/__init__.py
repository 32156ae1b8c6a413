"""seqbucket"""
